"""FlowPrefill's CPU row kernels (`--row-kernels cpu`: RMSNorm, SiLU-and-mul, RoPE in
engine/attention/cpu_flash.cpp) against torch's arithmetic on random shapes (widths that are no
multiple of a vector, strided rows), and a model on them against transformers."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import load_reference

from engine.attention import cpu
from engine.core.config import EngineConfig
from engine.core.kv_cache import KVCache
from engine.model import load_model
from engine.model.calibration import calibrate
from engine.model.cost import SeqSpan
from engine.model.kernels import CPUKernels, TorchKernels, select_kernels
from engine.model.plan import plan_prefill
from engine.model.rope import Rotary

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _built() -> None:
    for dtype in DTYPES:
        if cpu.runs(dtype):
            pytest.skip(f"FlowPrefill's CPU kernels: {cpu.runs(dtype)}")


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of want's dtype's last place (relative to the larger magnitude)."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return float(((got.float() - want.float()).abs() / scale).max() / eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 16), (7, 40), (33, 256), (64, 704)])
def test_rms_norm_and_silu_and_mul_are_torchs(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    wide = torch.randn(rows, 2 * width + 3, generator=gen).to(dtype)
    x = wide[:, :width]  # strided rows, as a slice of a wider tensor
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    ours, ref = CPUKernels(), TorchKernels()
    # One rounding of the dtype at most where both round (sums in another order, exp to fp32's epsilon).
    assert _ulps(ours.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)) <= (8 if dtype == torch.float32 else 1.01)
    gate_up = wide[:, : 2 * width]
    assert _ulps(ours.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)) <= (16 if dtype == torch.float32 else 1.01)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_rope_is_the_exact_rotation(dtype: torch.dtype, head_dim: int) -> None:
    heads, kv_heads, n = 4, 2, 37
    rotary = Rotary(head_dim, 10000.0, {}, 4096, dtype, torch.device("cpu"))
    rotary.use_fused(cpu.rope)
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    pos = torch.tensor(random.Random(0).sample(range(4096), n))
    got_q, got_k = rotary.apply(q, k, rotary.rows(pos))
    angles = pos.float()[:, None] * rotary.inv_freq  # torch's angles (fp32), the rotation in float64
    cos, sin = (torch.cat((f(angles), f(angles)), -1).unsqueeze(1).double() for f in (torch.cos, torch.sin))
    for x, got, h in ((q, got_q, heads), (k, got_k, kv_heads)):
        want = Rotary.rotate(x.double().view(n, h, head_dim), cos, sin)
        tol = 2e-6 if dtype == torch.float32 else 8e-3
        assert got.dtype == dtype and float((got.double() - want).abs().max() / want.abs().max()) < tol
    with pytest.raises(RuntimeError, match="position 4096 is past the table"):
        cpu.rope(torch.tensor([4096] * n), q, k, head_dim, rotary._cos_sin)


def test_chosen_automatically_where_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto takes them on a CPU where they build (this test module runs only there); where they cannot
    run, auto keeps torch's and cpu is an error naming why."""
    assert select_kernels("auto", torch.device("cpu"), torch.float32, 64, 128).name == "cpu"
    assert select_kernels("cpu", torch.device("cpu"), torch.float32, 64, 128).name == "cpu"
    with pytest.raises(ValueError, match="--row-kernels cpu: runs on the CPU"):
        select_kernels("cpu", torch.device("cuda"), torch.float32, 64, 128)
    monkeypatch.setattr(cpu, "runs", lambda dtype: "needs a CPU with AVX-512")
    assert select_kernels("auto", torch.device("cpu"), torch.float32, 64, 128).name == "torch"
    with pytest.raises(ValueError, match="--row-kernels cpu: needs a CPU with AVX-512"):
        select_kernels("cpu", torch.device("cpu"), torch.float32, 64, 128)


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen3", "llama_bias"])
def test_a_model_on_them_matches_transformers(kind: str, tiny_checkpoint: Callable[[str], Path]) -> None:
    """A ragged batch, split into the smallest steps, on the CPU kernels throughout (fp32)."""
    path = tiny_checkpoint(kind)
    model, _ = load_model(EngineConfig(model=str(path), row_kernels="cpu"))
    assert model.kernels.name == "cpu" and model.rotary.fused
    rng = random.Random(1)
    prompts = [[rng.randrange(model.cfg.vocab_size) for _ in range(n)] for n in (1, 19, 70)]
    spans = [SeqSpan(0, len(p)) for p in prompts]
    kv = KVCache(model.cfg, 16, 16 * 12, model.embed.dtype, model.device)
    tables = [kv.allocate(len(p)) for p in prompts]
    steps = plan_prefill(calibrate(model), spans, 1e-5)
    gen = model.prefill(prompts, spans, tables, kv, steps, all_logits=True)
    with torch.inference_mode():
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                logits = stop.value
                break
    ref = load_reference(path)
    row = 0
    for ids in prompts:
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float()
        got = logits[row : row + len(ids)]
        row += len(ids)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
