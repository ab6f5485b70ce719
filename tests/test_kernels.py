"""Row kernels (engine/model/kernels.py) off a GPU: the choice and the probe that guards FlashInfer's.
The fused kernels themselves are checked against torch's in tests/test_flashinfer.py (CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.model import load_model
from engine.model.kernels import TorchKernels, _probe, select_kernels


def test_torch_kernels_on_a_cpu_whatever_is_asked_for_automatically() -> None:
    assert select_kernels("auto", torch.device("cpu"), torch.bfloat16, 64, 128).name == "torch"
    assert load_model(EngineConfig())[0].kernels.name == "torch"
    with pytest.raises(ValueError, match="--row-kernels flashinfer: needs a CUDA device"):
        select_kernels("flashinfer", torch.device("cpu"), torch.bfloat16, 64, 128)
    with pytest.raises(ValueError, match="unknown row kernels 'triton'"):
        select_kernels("triton", torch.device("cpu"), torch.float32, 64, 128)


class _Off(TorchKernels):
    name = "off"

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return super().silu_and_mul(gate_up) * 1.1


def test_the_probe_refuses_kernels_that_disagree_with_torch() -> None:
    _probe(TorchKernels(), torch.device("cpu"), torch.bfloat16, 256, 704)
    with pytest.raises(RuntimeError, match="disagrees with torch"):
        _probe(_Off(), torch.device("cpu"), torch.bfloat16, 256, 704)


def test_torch_rms_norm_is_transformers_arithmetic() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(9, 64, dtype=torch.bfloat16)
    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    with torch.no_grad():
        assert torch.equal(TorchKernels().rms_norm(x, norm.weight, 1e-5), norm(x))
