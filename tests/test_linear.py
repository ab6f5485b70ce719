"""The projections' kernels (engine/model/linear.py): oneDNN's linear on pre-packed weights against
torch's matmul, with and without bias and residual, every row count the engine's steps use, fp32 and
bf16; the selection and its refusals; the kernels a new engine builds before its first request."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.core.config import ModelConfig
from engine.model.cost import ATTN_IN, FFN, ROW_ALIGN, OpCost, SeqSpan
from engine.model.linear import OneDnnLinear, TorchLinear, onednn_unavailable, select_linear
from engine.model.plan import plan_prefill

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _cpu_lacks(dtype: torch.dtype) -> str:
    """oneDNN's refusal for this CPU ("" where it runs): its bf16 path needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT. Only that refusal skips; a disagreement with torch's fails."""
    reason = onednn_unavailable(dtype)
    return reason if "needs the cpu support" in reason else ""


@onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 128, 513, 2048])
@pytest.mark.parametrize("out_in", [(384, 256), (256, 704), (1408, 256)])
def test_onednn_linear_matches_torchs(dtype: torch.dtype, tol: float, rows: int, out_in: tuple[int, int]) -> None:
    if reason := _cpu_lacks(dtype):
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(rows)
    out, inp = out_in
    w = (torch.randn(out, inp, generator=gen) / inp**0.5).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    residual = torch.randn(rows, out, generator=gen).to(dtype)
    for bias in (None, b):
        ours, ref = OneDnnLinear(w, bias), TorchLinear(w, bias)
        for r in (None, residual):
            got, want = ours(x, r), ref(x, r)
            assert got.shape == want.shape == (rows, out) and got.dtype == dtype
            err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
            assert err < tol, (bias is not None, r is not None, err)


@onednn
def test_a_row_slice_of_a_batch_is_its_own_projection() -> None:
    """The engine projects x[a:b] of a batch (a step's rows): the same rows as the whole batch's."""
    w, x = torch.randn(96, 64), torch.randn(300, 64)
    lin = OneDnnLinear(w, None)
    assert torch.allclose(lin(x[100:137]), lin(x)[100:137], rtol=1e-5, atol=1e-5)


@onednn
def test_onednn_meets_row_counts_in_steps_of_row_align(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN builds a kernel for every row count it meets (~1.7 ms each, the first time): rows past
    ROW_ALIGN are padded to a multiple of it (fewer run as they are), and the padding never reaches the
    caller, residual or not."""
    from engine.model import linear

    seen: list[int] = []
    real = linear.onednn_linear
    monkeypatch.setattr(linear, "onednn_linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    ours, ref = OneDnnLinear(w, b), TorchLinear(w, b)
    for rows in (1, 15, 16, 37, 300):
        x, r = torch.randn(rows, 64, generator=gen), torch.randn(rows, 96, generator=gen)
        for residual in (None, r):
            got = ours(x, residual)
            assert got.shape == (rows, 96) and torch.allclose(got, ref(x, residual), rtol=1e-4, atol=1e-4)
    assert seen == [1, 1, 15, 15, 16, 16, 48, 48, 304, 304]


def test_selection() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_linear("torch", cpu, torch.float32) is TorchLinear
    assert select_linear("auto", cuda, torch.bfloat16) is TorchLinear  # CUDA keeps torch's (cuBLAS)
    assert select_linear("auto", cpu, torch.float16) is TorchLinear
    if torch.backends.mkldnn.is_available():
        assert select_linear("auto", cpu, torch.float32) is OneDnnLinear
    with pytest.raises(ValueError, match="--linear onednn: runs on the CPU"):
        select_linear("onednn", cuda, torch.float32)
    with pytest.raises(ValueError, match="unknown linear kernels 'mkl'"):
        select_linear("mkl", cpu, torch.float32)


@onednn
def test_where_the_cpu_refuses_onednn_torchs_runs_and_the_cause_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """Where this CPU cannot run oneDNN's bf16 path (no AVX-512), auto falls back to torch's matmuls
    with a warning naming the cause, and an explicit --linear onednn is an error with it."""
    reason = _cpu_lacks(torch.bfloat16)
    if not reason:
        assert select_linear("auto", torch.device("cpu"), torch.bfloat16) is OneDnnLinear
        return
    with caplog.at_level("WARNING"):
        assert select_linear("auto", torch.device("cpu"), torch.bfloat16) is TorchLinear
    assert "needs the cpu support" in caplog.text
    with pytest.raises(ValueError, match=r"--linear onednn: RuntimeError: .*needs the cpu support"):
        select_linear("onednn", torch.device("cpu"), torch.bfloat16)


def _padded(rows: int) -> int:
    """The row count oneDNN's linear runs a step of `rows` rows on (OneDnnLinear pads past ROW_ALIGN)."""
    return rows if rows <= ROW_ALIGN else -(-rows // ROW_ALIGN) * ROW_ALIGN


@pytest.mark.parametrize("budget_s", [0.002, 0.0005, None])
def test_the_warmed_row_counts_cover_every_step_a_plan_cuts(budget_s: float | None) -> None:
    """`OpCost.step_rows` names every row count a row-wise step runs on, for batches of one to many
    prompts, of every length up to past the batch cap, at corrections from half to 20x calibration:
    what the engine warms at start covers what its prefills meet."""
    cost = OpCost(ModelConfig(), attn_in_s_per_row=2.3e-6, ffn_s_per_row=9e-6, attn_s_per_pair=7e-8)
    most = 2048
    want = {op: set(cost.step_rows(op, budget_s, most)) for op in (ATTN_IN, FFN)}
    lengths = [1, 5, 16, 17, 100, 333, 512, 777, 1500, 2048]
    batches = [[n] for n in lengths] + [[3, 40], [200, 9, 511], [700, 700, 648], [1] * 30]
    for scale in (0.5, 0.8, 1.0, 1.7, 20.0):
        for lengths_ in batches:
            plan = plan_prefill(replace(cost, scale=scale), [SeqSpan(0, n) for n in lengths_], budget_s,
                                last_token_only=True)
            for step in plan:
                if step.op in want:
                    assert _padded(step.rows[1] - step.rows[0]) in want[step.op], (scale, lengths_, step)
    if budget_s is None:  # one step per operator: every batch size up to the cap
        assert max(want[FFN]) == max(want[ATTN_IN]) == most
    else:  # the budget bounds each op by its own cost
        assert max(want[FFN]) < max(want[ATTN_IN]) < most


# A fresh process: oneDNN's kernels are cached per process, and other tests' engines build them too.
_FRESH_ENGINE = """
import torch
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.linear import OneDnnLinear
from engine.model.plan import SeqSpan, plan_prefill
engine = Engine(EngineConfig(num_threads=1))
kv = engine.kv
print("prefills:", flush=True)
with torch.inference_mode(), torch.backends.mkldnn.verbose(1):
    for lengths in ([700], [1], [33, 1500], [250] * 8, [2000], [90, 91, 92]):
        spans = [SeqSpan(0, n) for n in lengths]
        tables = [kv.allocate(n) for n in lengths]
        steps = plan_prefill(engine.cost, spans, engine.budget_s, last_token_only=True)
        for _ in engine.model.prefill([[65] * n for n in lengths], spans, tables, kv, steps):
            pass
        for t in tables:
            kv.free(t)
    print("control:", flush=True)
    OneDnnLinear(torch.randn(40, 24), None)(torch.randn(3, 24))
"""


@onednn
def test_a_fresh_engine_builds_no_kernel_in_its_prefills() -> None:
    """oneDNN says (its verbose mode) when it builds a kernel: a new engine's first prefills, of every
    size, build none, since it warmed them at start; a projection of a shape no step has still shows
    one, so this test sees what it counts."""
    out = subprocess.run([sys.executable, "-c", _FRESH_ENGINE], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent, check=True).stdout
    prefills, control = out.split("prefills:")[1].split("control:")
    assert prefills.count("cache_miss") == 0, prefills
    assert control.count("cache_miss") >= 1
