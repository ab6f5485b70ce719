"""The row-wise kernels between the matmuls: RMSNorm, SiLU-and-mul and the rotary embedding.

In torch, RMSNorm is seven kernels over the rows in fp32 (cast, square, mean, rsqrt, scale, cast,
weight) and SiLU-and-mul two more over the MLP's widest tensor. On a GPU they are pure memory
traffic: for an 8B model at 8K tokens about a gigabyte per norm and per MLP and layer, some 6 % of a
prefill. FlashInfer's fused kernels (the ones vLLM and SGLang use) read and write each tensor once.
They compute the norm in fp32 and round once, where transformers rounds before the weight: results
differ by bfloat16 rounding, as the attention kernels' do. With them the engine also rotates q and k
with FlashInfer's RoPE kernel (`fuse_rope`, engine/model/rope.py): one kernel where torch runs five
over each, about 1.5 % of an 8K prefill of an 8B model on an H200.

`select_kernels` probes FlashInfer's on the model's device before using them (one call each at the
model's widths, checked against torch): if either fails to load or disagrees, the engine keeps torch's
for both, with a warning; `fuse_rope` probes the RoPE kernel the same way, on its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engine.attention import cpu

if TYPE_CHECKING:
    from engine.model.rope import Rotary

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


class CPUKernels:
    """FlowPrefill's own, on the CPU (engine/attention/cpu_flash.cpp, built with the attention kernel):
    each one pass over its rows where torch's are seven and two, with torch's roundings. On the
    default model at 8K tokens the row operators were about 6 % of a bf16 prefill in torch, and each
    eager torch operator costs some microseconds of dispatch in every one of a split prefill's steps."""

    name = "cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu.silu_and_mul(gate_up)


def _cpu_kernels(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> RowKernels | str:
    """FlowPrefill's, or why they cannot run here (not built for this CPU or dtype, or disagreeing with torch's)."""
    reason = cpu.runs(dtype)
    if not reason:
        try:
            _probe(CPUKernels(), device, dtype, hidden, intermediate)
            return CPUKernels()
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
    return reason


def _auto_on_cpu(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> RowKernels:
    """FlowPrefill's where they build and agree with torch's: on SmolLM2 (one EPYC core, interleaved) a
    2K prefill ran 5-7 % faster with them in fp32 and bf16, a split 512 one 21 %, since every step runs
    one operator where torch's run seven and two. Elsewhere torch's, with the reason in the log."""
    kernels = _cpu_kernels(device, dtype, hidden, intermediate)
    if isinstance(kernels, str):
        log.info("FlowPrefill's CPU row kernels are not used (%s); torch's run instead", kernels)
        return TorchKernels()
    return kernels


def select_kernels(name: str, device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int
                   ) -> RowKernels:
    """name: auto (FlashInfer's on CUDA in 16-bit, FlowPrefill's on a CPU, when they load and agree with
    torch's), torch, flashinfer or cpu (FlashInfer's or FlowPrefill's; a failure is an error).
    hidden, intermediate: the model's widths."""
    if name == "torch":
        return TorchKernels()
    if name not in ("auto", "flashinfer", "cpu"):
        raise ValueError(f"unknown row kernels {name!r} (auto, torch, flashinfer, cpu)")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("--row-kernels cpu: runs on the CPU (--device cpu)")
        kernels = _cpu_kernels(device, dtype, hidden, intermediate)
        if isinstance(kernels, str):
            raise ValueError(f"--row-kernels cpu: {kernels}")
        return kernels
    if name == "auto" and device.type == "cpu":
        return _auto_on_cpu(device, dtype, hidden, intermediate)
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


def fuse_rope(rotary: Rotary, heads: int, kv_heads: int, required: bool, kernels: str = "flashinfer") -> None:
    """Rotate with the fused kernel of `kernels` (flashinfer: FlashInfer's; cpu: FlowPrefill's, of the
    same signature and arithmetic) if it loads and agrees with the exact rotation at positions up to
    the model's context; otherwise keep torch's (required: the failure is an error)."""
    try:
        if kernels == "cpu":
            kernel = cpu.rope
        else:
            from flashinfer.rope import apply_rope_with_cos_sin_cache as kernel

        rotary.use_fused(kernel)
        _probe_rope(rotary, heads, kv_heads)
    except Exception as e:  # any failure means: rotate with torch
        rotary.use_fused(None)
        if required:
            raise ValueError(f"--row-kernels {kernels}: RoPE: {type(e).__name__}: {e}") from e
        log.warning("%s RoPE kernel is not used (%s: %s); torch's rotation runs instead",
                    "FlowPrefill's CPU" if kernels == "cpu" else "FlashInfer's", type(e).__name__, e)


def _probe_rope(rotary: Rotary, heads: int, kv_heads: int) -> None:
    d, dev = rotary.head_dim, rotary.device
    gen = torch.Generator(device=dev).manual_seed(0)
    # Laid out as in the model: q and k are column slices of one fused projection's output.
    qkv = torch.randn(64, (heads + 2 * kv_heads) * d, device=dev, dtype=rotary.dtype, generator=gen)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    pos = torch.randint(0, rotary.max_pos, (64,), device=dev, generator=gen)
    pos[0] = rotary.max_pos - 1
    got = rotary.apply(q, k, rotary.rows(pos))
    angles = pos.float()[:, None] * rotary.inv_freq  # torch's angles (float32), rotated in float32
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).unsqueeze(1) * rotary.scale for f in (torch.cos, torch.sin))
    for x, y, n in ((q, got[0], heads), (k, got[1], kv_heads)):
        want = rotary.rotate(x.float().view(-1, n, d), cos, sin)
        err = float((y.float() - want).abs().max() / want.abs().max())
        if y.shape != want.shape or not err < 2e-2:
            raise RuntimeError(f"disagrees with torch (shape {tuple(y.shape)}, max relative error {err:.2g})")
