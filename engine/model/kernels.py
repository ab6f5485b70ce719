"""The row-wise kernels between the matmuls: RMSNorm and SiLU-and-mul.

In torch, RMSNorm is seven kernels over the rows in fp32 (cast, square, mean, rsqrt, scale, cast,
weight) and SiLU-and-mul two more over the MLP's widest tensor. On a GPU they are pure memory
traffic: for an 8B model at 8K tokens about a gigabyte per norm and per MLP and layer, some 6 % of a
prefill. FlashInfer's fused kernels (the ones vLLM and SGLang use) read and write each tensor once.
They compute the norm in fp32 and round once, where transformers rounds before the weight: results
differ by bfloat16 rounding, as the attention kernels' do.

`select_kernels` probes FlashInfer's on the model's device before using them (one call each at the
model's widths, checked against torch): if either fails to load or disagrees, the engine keeps torch's
for both, with a warning.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class RowKernels(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, hidden] normalised by its root mean square, times weight [hidden]."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up = [gate | up] along the last dimension."""


class TorchKernels:
    """transformers' arithmetic, op for op (the reference tests compare against it)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FlashInferKernels:
    name = "flashinfer"

    def __init__(self) -> None:
        from flashinfer.activation import silu_and_mul
        from flashinfer.norm import rmsnorm

        self._rmsnorm, self._silu_and_mul = rmsnorm, silu_and_mul

    # enable_pdl=False: no programmatic dependent launch (which would let these kernels start before
    # the previous one, a cuBLAS matmul, ends, and wait inside): plain launches, plain graph capture.
    # The weight is read as the input's dtype, unchecked: the model casts every weight to its dtype.
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rmsnorm(x, weight, eps, enable_pdl=False)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up, enable_pdl=False)


def select_kernels(name: str, device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int
                   ) -> RowKernels:
    """name: auto (FlashInfer's on CUDA in 16-bit when they load and agree with torch's), torch,
    or flashinfer (the same, but a failure is an error). hidden, intermediate: the model's widths."""
    if name == "torch":
        return TorchKernels()
    if name not in ("auto", "flashinfer"):
        raise ValueError(f"unknown row kernels {name!r} (auto, torch, flashinfer)")
    reason = ("needs a CUDA device" if device.type != "cuda"
              else "needs bfloat16 or float16" if dtype not in (torch.bfloat16, torch.float16)
              # the kernels load 16 bytes at a time, from the start of each row and of its second half
              else f"needs widths that are multiples of 8 (hidden {hidden}, intermediate {intermediate})"
              if hidden % 8 or intermediate % 8 else None)
    if reason is None:
        try:
            kernels = FlashInferKernels()
            _probe(kernels, device, dtype, hidden, intermediate)
            return kernels
        except Exception as e:  # any failure means: serve with torch's kernels
            reason = f"{type(e).__name__}: {e}"
    if name == "flashinfer":
        raise ValueError(f"--row-kernels flashinfer: {reason}")
    if device.type == "cuda":
        log.warning("FlashInfer's fused RMSNorm/SiLU kernels are not used (%s); torch's run instead", reason)
    return TorchKernels()


def _probe(kernels: RowKernels, device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, hidden, device=device, dtype=dtype, generator=gen)
    w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype, generator=gen)
    gate_up = torch.randn(64, 2 * intermediate, device=device, dtype=dtype, generator=gen)
    ref = TorchKernels()
    for got, want in ((kernels.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)),
                      (kernels.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))):
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        if got.shape != want.shape or not err < 2e-2:
            raise RuntimeError(f"disagrees with torch (shape {tuple(got.shape)}, max relative error {err:.2g})")
