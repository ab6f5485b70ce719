"""The model's projections (q/k/v, o, gate/up, down): y = x W^T + bias (+ a residual added in the same
operator), with each weight stored in the layout its kernel reads.

`TorchLinear` is torch's matmul on a transposed copy of the weight (addmm for the residual). On a CPU,
torch sends fp32 matmuls to MKL's sgemm, and on an AMD EPYC with AVX-512 MKL runs its AVX2
path: 89-97 GFLOP/s on one core for this model's shapes (rows x 256 by 256 x 1408, 704 x 256, 256 x 384),
where oneDNN's reaches 200-228 with the weights pre-packed (185-219 unpacked). bf16 matmuls already go
to oneDNN; packing adds 3-20 % (most at 128 rows). So `OneDnnLinear` keeps the weight packed in oneDNN's
blocked layout (torch.ops.mkldnn._reorder_linear_weight, what inductor's CPU backend packs with) and runs
oneDNN's linear with the residual as a fused binary post-op, as vLLM's CPU linear runs oneDNN on
pre-packed weights. Both agree with a float64 reference to 4e-7 relative in fp32.
"""

from __future__ import annotations

import logging

import torch

from engine.model.cost import ROW_ALIGN

log = logging.getLogger("flowprefill.engine")

# The batch size oneDNN packs for (its choice of blocking); any number of rows runs on the packed weight.
PACK_ROWS = 512


class TorchLinear:
    name = "torch"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight_t, self.bias = weight.t().contiguous(), bias

    @classmethod
    def _of(cls, weight_t: torch.Tensor, bias: torch.Tensor | None) -> TorchLinear:
        out = cls.__new__(cls)
        out.weight_t, out.bias = weight_t, bias
        return out

    def out_slice(self, weight: torch.Tensor, a: int, b: int) -> TorchLinear:
        """This projection's outputs [a, b) alone (`weight` is the one it was built from): a view, no copy."""
        return self._of(self.weight_t[:, a:b], None if self.bias is None else self.bias[a:b])

    def in_slice(self, weight: torch.Tensor, a: int, b: int) -> TorchLinear:
        """The part of this bias-free projection that reads inputs [a, b): a view, no copy."""
        assert self.bias is None, "a bias would be added by every input slice"
        return self._of(self.weight_t[a:b], None)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        out = torch.addmm(residual, x, self.weight_t)  # the residual added by the matmul itself
        if self.bias is not None:
            out += self.bias
        return out


# oneDNN builds a kernel (a primitive) for every number of rows it meets, and its first call with a new
# row count costs ~1.7 ms more than the next ones (2x a 600-row call of this model's gate/up; torch's
# matmul: 0.03 ms). FlowPrefill's batches come in every size, so a fresh worker paid it for nearly every
# batch: the same 200 requests ran 11.8-13.7 s on a fresh engine and 10.1 s on the third pass. Rows past
# ROW_ALIGN are padded to a multiple of it, so that a worker meets at most 1/16 as many row counts, and
# the engine builds each of those at start (Engine._warm_steps).


class OneDnnLinear:
    name = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        self.bias = bias

    # A packed weight's blocks span output columns, so a slice is packed again from the plain weight:
    # SmolLM2-135M's MLP slices add 318 MB (fp32) to its 540 MB; decode and unsplit steps keep the whole.
    def out_slice(self, weight: torch.Tensor, a: int, b: int) -> OneDnnLinear:
        """This projection's outputs [a, b) alone (`weight` is the one it was built from)."""
        return OneDnnLinear(weight[a:b], None if self.bias is None else self.bias[a:b])

    def in_slice(self, weight: torch.Tensor, a: int, b: int) -> OneDnnLinear:
        """The part of this bias-free projection that reads inputs [a, b)."""
        assert self.bias is None, "a bias would be added by every input slice"
        return OneDnnLinear(weight[:, a:b].contiguous(), None)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        # Up to ROW_ALIGN rows run as they are: a batch's last-token FFN steps are 1 row per sequence, and 16
        # would double them (153-169 against 78-81 us on one core); those are at most 16 kernels.
        if x.dim() == 2 and rows > ROW_ALIGN and (pad := -rows % ROW_ALIGN):
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
            residual = None if residual is None else torch.nn.functional.pad(residual, (0, 0, 0, pad))
            return onednn_linear(x, self.packed, self.bias, residual)[:rows]
        return onednn_linear(x, self.packed, self.bias, residual)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a packed weight, the residual added as a fused post-op."""
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), packed, bias, "add")


LinearKind = type[TorchLinear] | type[OneDnnLinear]  # what LlamaModel builds its projections with


def onednn_unavailable(dtype: torch.dtype) -> str:
    """Why oneDNN's linear cannot serve here ("" when it can): missing, or disagreeing with torch's."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"no oneDNN linear for {dtype}"
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x, r = torch.randn(37, 64, generator=gen).to(dtype), torch.randn(37, 96, generator=gen).to(dtype)
    try:
        got, ref = OneDnnLinear(w, b)(x, r).double(), TorchLinear(w, b)(x, r).double()
    except (RuntimeError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    err = float((got - ref).abs().max() / ref.abs().max())
    return "" if err < (1e-5 if dtype == torch.float32 else 2e-2) else f"disagrees with torch's (error {err:.2g})"


def select_linear(name: str, device: torch.device, dtype: torch.dtype) -> LinearKind:
    """name: auto (oneDNN's on a CPU in fp32/bf16 when it loads and agrees with torch's), torch, or onednn
    (the same, a failure an error)."""
    if name not in ("auto", "torch", "onednn"):
        raise ValueError(f"unknown linear kernels {name!r} (auto, torch, onednn)")
    if name == "torch" or (name == "auto" and (device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16))):
        return TorchLinear
    reason = "runs on the CPU (--device cpu)" if device.type != "cpu" else onednn_unavailable(dtype)
    if not reason:
        return OneDnnLinear
    if name == "onednn":
        raise ValueError(f"--linear onednn: {reason}")
    log.warning("oneDNN's linear is not used (%s); torch's matmuls run instead", reason)
    return TorchLinear
