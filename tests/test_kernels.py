"""Row kernels (engine/model/kernels.py) off a GPU: the choice and the probe that guards FlashInfer's.
The fused kernels themselves are checked against torch's in tests/test_flashinfer.py (CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core.config import EngineConfig
from engine.model import load_model
from engine.model.kernels import TorchKernels, _probe, select_kernels


def test_on_a_cpu_auto_never_takes_flashinfers() -> None:
    """auto on a CPU: FlowPrefill's row kernels where they run (tests/test_cpu_row_kernels.py), else torch's."""
    from engine.attention.cpu import runs

    want = "torch" if runs(torch.bfloat16) else "cpu"
    assert select_kernels("auto", torch.device("cpu"), torch.bfloat16, 64, 128).name == want
    assert load_model(EngineConfig(row_kernels="torch"))[0].kernels.name == "torch"
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


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_the_kernel_build_runs_on_the_cores_given_not_the_pinned_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve pins a worker's compute to one core before its model loads: the one-time kernel build
    (two compilers, ~19 s of CPU) must not be confined there with the GGUF's conversion."""
    import engine.model as model_module
    from engine.attention import cpu

    every = set(os.sched_getaffinity(0))
    seen: list[set[int]] = []
    monkeypatch.setattr(cpu, "build", lambda: seen.append(set(os.sched_getaffinity(0))))
    os.sched_setaffinity(0, {min(every)})  # as Engine's pin_compute leaves the loading thread
    try:
        thread = model_module._cpu_kernels_built_meanwhile(EngineConfig(), torch.device("cpu"), every)
        assert thread is not None
        thread.join(timeout=30)
    finally:
        os.sched_setaffinity(0, every)
    assert seen == [every]
