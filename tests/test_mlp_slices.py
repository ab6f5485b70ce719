"""The FFN cut by the MLP's intermediate columns as well as by rows (`OpCost.sliced_ffn_rows`).

Where the whole FFN's row blocks that fit the step budget are too short to run well (each re-reads all
its weights), a block runs as an FFN_IN step (o_proj + residual + norm) and one MLP step per column
slice. Its plan partitions every row into blocks taller than the whole FFN's, each slice once per
block; the prediction of the prefill is its plan; its output equals the unsplit forward's to fp32
rounding, and a prefill preempted at any boundary between its steps resumes to the same bits.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from helpers import drain
from test_preemption import CFG, EXACT, FP32, Case, assert_kv_equal, fresh_kv, kv_of, make_weights, prompt, run

from engine.attention.sdpa import SDPABackend
from engine.core.config import ModelConfig
from engine.model.calibration import _median_of, calibrate, measured_profile
from engine.model.cost import FFN, FFN_IN, MLP, OpCost, SeqSpan
from engine.model.linear import OneDnnLinear, TorchLinear, onednn_unavailable
from engine.model.llama import MLP_SLICE_MIN_BYTES, LlamaModel, mlp_slices
from engine.model.plan import plan_prefill

# The whole FFN costs 10 us a row: 32-row blocks (the least) under a 100 us budget; a slice's MLP step
# 1 us a row: 96-row blocks.
SLICES = 2
COST = OpCost(CFG, attn_in_s_per_row=1e-6, ffn_s_per_row=1e-5, attn_s_per_pair=1e-8, step_overhead_s=0.0,
              mlp_slices=SLICES, ffn_in_s_per_row=5e-7, mlp_s_per_row=1e-6)
BUDGET = 1e-4
LINEARS = [TorchLinear, pytest.param(OneDnnLinear, marks=pytest.mark.skipif(
    bool(onednn_unavailable(torch.float32)), reason="no oneDNN linear"))]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=LINEARS, ids=lambda kind: kind.name)
def model(request: pytest.FixtureRequest) -> LlamaModel:
    return LlamaModel(CFG, make_weights(CFG), SDPABackend(), linear=request.param, slices=SLICES)


def ffn_steps(plan: list, layer: int = 0) -> list:
    return [s for s in plan if s.layer == layer and s.op in (FFN, FFN_IN, MLP)]


# -- how many slices ----------------------------------------------------------------------------

def test_slices_are_chosen_from_the_mlp_shape() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    smol = ModelConfig(hidden_size=576, intermediate_size=1536)  # SmolLM2-135M: 10.6 MB of fp32 MLP
    assert mlp_slices(smol, torch.float32, cpu) == 8, "3 x 1536 / 576: a slice costs o_proj's per row"
    assert mlp_slices(smol, torch.bfloat16, cpu) == 8
    assert mlp_slices(smol, torch.float32, cuda) == 1, "unmeasured on a GPU"
    assert mlp_slices(ModelConfig(), torch.float32, cpu) == 1, "the embedded model's 2.2 MB MLP stays whole"
    assert MLP_SLICE_MIN_BYTES >= 3 * 256 * 704 * 4
    qwen = ModelConfig(hidden_size=896, intermediate_size=4864)  # Qwen2.5-0.5B: 17 slices of 4864 would not divide
    s = mlp_slices(qwen, torch.float32, cpu)
    assert s >= 3 * 4864 / 896 and 4864 % s == 0 and 4864 // s % 16 == 0
    assert mlp_slices(ModelConfig(hidden_size=4096, intermediate_size=4099), torch.float32, cpu) == 1


def test_a_sliced_model_keeps_the_whole_projections_and_views_them_in_torch() -> None:
    m = LlamaModel(CFG, make_weights(CFG), SDPABackend(), linear=TorchLinear, slices=SLICES)
    layer = m.layers[0]
    assert len(layer.mlp) == SLICES
    for gate_up, down in layer.mlp:  # views of the whole projections: no second copy of the weights
        assert gate_up.weight_t.untyped_storage().data_ptr() == layer.gate_up.weight_t.untyped_storage().data_ptr()
        assert down.weight_t.untyped_storage().data_ptr() == layer.down.weight_t.untyped_storage().data_ptr()
    assert LlamaModel(CFG, make_weights(CFG), SDPABackend()).layers[0].mlp == []


# -- the plan ------------------------------------------------------------------------------------

def test_sliced_plan_partitions_every_block_into_each_slice() -> None:
    spans = [SeqSpan(0, 300), SeqSpan(20, 47)]
    rows = sum(s.length for s in spans)
    plan = plan_prefill(COST, spans, BUDGET)
    whole = plan_prefill(replace(COST, mlp_slices=1), spans, BUDGET)
    for layer in range(CFG.num_hidden_layers):
        steps = ffn_steps(plan, layer)
        blocks = [s.rows for s in steps if s.op == FFN_IN]
        assert blocks[0][0] == 0 and blocks[-1][1] == rows
        assert all(a[1] == b[0] for a, b in pairwise(blocks))
        # each block: its FFN_IN step, then one MLP step per slice, in order, on its rows
        assert len(steps) == len(blocks) * (1 + SLICES)
        for i, block in enumerate(blocks):
            group = steps[i * (1 + SLICES):(i + 1) * (1 + SLICES)]
            assert [s.op for s in group] == [FFN_IN] + [MLP] * SLICES
            assert [s.part for s in group[1:]] == list(range(SLICES))
            assert all(s.rows == block for s in group)
    assert all(s.cost <= BUDGET for s in plan if s.op in (FFN_IN, MLP))
    sliced_rows = max(b - a for _, op, (a, b), *_ in plan if op == MLP)
    whole_rows = max(b - a for _, op, (a, b), *_ in whole if op == FFN)
    assert sliced_rows == 96 and whole_rows == 32, "the blocks grow by what a slice saves per row"


@pytest.mark.parametrize(("why", "cost", "spans", "budget"), [
    ("no slices", replace(COST, mlp_slices=1), [SeqSpan(0, 300)], BUDGET),
    ("not measured", replace(COST, mlp_s_per_row=0.0), [SeqSpan(0, 300)], BUDGET),
    ("whole blocks tall enough", replace(COST, ffn_s_per_row=5e-7), [SeqSpan(0, 300)], BUDGET),
    ("one whole step fits", COST, [SeqSpan(0, 30)], BUDGET),
    ("no budget", COST, [SeqSpan(0, 300)], None),
])
def test_the_ffn_is_sliced_only_where_whole_blocks_would_be_short(why: str, cost: OpCost, spans: list[SeqSpan],
                                                                  budget: float | None) -> None:
    assert {s.op for s in ffn_steps(plan_prefill(cost, spans, budget))} == {FFN}, why


def test_the_last_layer_of_a_serving_plan_runs_its_last_tokens_whole() -> None:
    spans = [SeqSpan(0, 300), SeqSpan(0, 40)]
    plan = plan_prefill(COST, spans, BUDGET, last_token_only=True)
    last = ffn_steps(plan, CFG.num_hidden_layers - 1)
    assert [(s.op, s.rows) for s in last] == [(FFN, (299, 300)), (FFN, (339, 340))]
    assert {s.op for s in ffn_steps(plan, 0)} == {FFN_IN, MLP}


def test_the_prediction_of_a_sliced_prefill_is_its_plan() -> None:
    # attention cheap enough to split little (its own count is test_predictor's)
    cost = replace(COST, attn_s_per_pair=1e-10, step_overhead_s=20e-6, row_step_floor_s=5e-6, budget_s=BUDGET)
    for spans in ([SeqSpan(0, 300)], [SeqSpan(0, 40), SeqSpan(0, 24)], [SeqSpan(512, 200)],
                  [SeqSpan(0, 2048)], [SeqSpan(0, 5000)]):
        plan = plan_prefill(cost, spans, BUDGET, last_token_only=True)
        # the FFN's steps: per block an FFN_IN step and a step per slice, each with its overhead (a short
        # last block's FFN_IN step may cost the floor, 1 us more)
        rows = sum(s.length for s in spans)
        assert cost._sliced_ffn_s(rows, 1.0) == pytest.approx(sum(s.cost for s in ffn_steps(plan)), rel=0.01)
        if rows >= 2048:  # the whole prefill, within what rounding other operators' blocks costs (test_predictor's)
            assert cost.prefill_s(spans) == pytest.approx(plan.total_cost, rel=0.05), spans
    slow = replace(cost, scale=1.5)  # a slower device: smaller blocks, more steps, still its plan
    plan = plan_prefill(slow, [SeqSpan(0, 2048)], BUDGET, last_token_only=True)
    assert max(b - a for _, op, (a, b), *_ in plan if op == MLP) < 96
    assert slow.prefill_s([SeqSpan(0, 2048)]) == pytest.approx(plan.total_cost, rel=0.05)


# -- the forward ---------------------------------------------------------------------------------

def logits(model: LlamaModel, spans: list[SeqSpan], budget: float | None, cost: OpCost = COST) -> torch.Tensor:
    kv = fresh_kv()
    ids = [prompt(s.start + s.length, i) for i, s in enumerate(spans)]
    tables = [kv.allocate(s.start + s.length) for s in spans]
    with torch.inference_mode():
        for i, s in enumerate(spans):  # the cached prefixes of chunks
            if s.start:
                head = [SeqSpan(0, s.start)]
                drain(model.prefill([ids[i][:s.start]], head, [tables[i]], kv, plan_prefill(cost, head, None)))
        plan = plan_prefill(cost, spans, budget)
        return drain(model.prefill([p[s.start:] for p, s in zip(ids, spans, strict=True)], spans, tables, kv, plan,
                                   all_logits=True))


@pytest.mark.parametrize("slices", [SLICES, 4])
def test_sliced_split_equals_the_unsplit_forward(slices: int) -> None:
    for kind in (TorchLinear, OneDnnLinear) if not onednn_unavailable(torch.float32) else (TorchLinear,):
        plain = LlamaModel(CFG, make_weights(CFG), SDPABackend(), linear=kind)
        sliced = LlamaModel(CFG, make_weights(CFG), SDPABackend(), linear=kind, slices=slices)
        cost = replace(COST, mlp_slices=slices)
        spans = [SeqSpan(0, 300), SeqSpan(0, 47), SeqSpan(130, 120), SeqSpan(0, 1)]
        assert any(s.op == MLP for s in plan_prefill(cost, spans, BUDGET))
        want = logits(plain, spans, None, cost)
        torch.testing.assert_close(logits(sliced, spans, None, cost), want, **FP32)  # whole, interleaved gate/up
        torch.testing.assert_close(logits(sliced, spans, BUDGET, cost), want, **FP32)
        # decode runs the whole projections of the interleaved gate/up
        kv = fresh_kv()
        table = kv.allocate(8)
        outs = [m.decode([5], [0], [table], kv) for m in (plain, sliced)]
        torch.testing.assert_close(outs[1], outs[0], **FP32)


def test_a_sliced_prefill_preempted_at_every_boundary_resumes_exactly(model: LlamaModel) -> None:
    case = Case([[(150, 0, 150), (134, 64, 70)], [(90, 0, 90)]], BUDGET, COST)
    (ref_a, ref_a_kv), (ref_b, _) = case.reference(model)
    steps = case.setup(model, fresh_kv())[0].steps
    assert {s.op for s in steps} >= {FFN_IN, MLP}
    for k in range(len(steps) + 1):
        kv = fresh_kv()
        a, b = case.setup(model, kv)
        assert not run(a, k)
        assert run(b), "the other batch runs to completion in between"
        torch.testing.assert_close(b.logits, ref_b, **EXACT)
        assert run(a)
        torch.testing.assert_close(a.logits, ref_a, rtol=0.0, atol=0.0, msg=lambda m, k=k: f"after step {k}: {m}")
        assert_kv_equal(kv_of(kv, a), ref_a_kv)


# -- warm-up and calibration ---------------------------------------------------------------------

def test_calibration_measures_the_slices_and_the_profile_keeps_them(model: LlamaModel) -> None:
    cost = calibrate(model)
    assert cost.mlp_slices == SLICES and cost.ffn_in_s_per_row > 0 and cost.mlp_s_per_row > 0
    profile = measured_profile(cost)
    assert _median_of(model, [profile]).mlp_s_per_row == pytest.approx(cost.mlp_s_per_row)
    older = {k: v for k, v in profile.items() if k not in ("ffn_in_s_per_row", "mlp_s_per_row")}
    # a profile from before slices: the FFN is cut by rows only
    stored = replace(_median_of(model, [older]), ffn_s_per_row=1e-5)
    assert stored.mlp_slices == SLICES and stored.mlp_s_per_row == 0.0
    assert {s.op for s in ffn_steps(plan_prefill(stored, [SeqSpan(0, 300)], BUDGET))} == {FFN}
    plain = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    assert calibrate(plain).mlp_s_per_row == 0.0


def test_calibration_times_a_decode_step_and_the_profile_keeps_it(model: LlamaModel) -> None:
    """What the simulator charges a decode step: one answer's, each answer more, each context token more;
    a profile from before decode was timed says 0 (decode takes no time there)."""
    cost = calibrate(model)
    assert cost.decode_s > 0 and cost.decode_s_per_seq >= 0 and cost.decode_s_per_token >= 0
    assert cost.decode_step_s(4, 400) >= cost.decode_step_s(1, 100) > 0 == cost.decode_step_s(0, 0)
    profile = measured_profile(cost)
    assert _median_of(model, [profile]).decode_s == pytest.approx(cost.decode_s)
    older = {k: v for k, v in profile.items() if not k.startswith("decode_")}
    assert _median_of(model, [older]).decode_step_s(4, 400) == 0.0


def test_the_warmed_row_counts_cover_every_sliced_step() -> None:
    """`OpCost.step_rows(MLP)` names every row count an FFN_IN or MLP step runs on (what the engine
    warms at start), for batches of one to many prompts at corrections from half to 20x calibration;
    none where the FFN is never cut by columns."""
    most = 2048
    want = set(COST.step_rows(MLP, BUDGET, most))
    assert max(want) >= 96
    for lengths in ([100], [333], [2048], [40, 24], [700, 700, 648], [1] * 30, [5000]):
        for scale in (0.5, 1.0, 1.7, 20.0):
            plan = plan_prefill(replace(COST, scale=scale), [SeqSpan(0, n) for n in lengths], BUDGET,
                                last_token_only=True)
            for step in plan:
                if step.op in (FFN_IN, MLP):
                    n = step.rows[1] - step.rows[0]
                    assert (n if n <= 16 else -(-n // 16) * 16) in want, (lengths, scale, step)
    assert COST.step_rows(MLP, None, most) == []
    assert replace(COST, mlp_slices=1).step_rows(MLP, BUDGET, most) == []
    assert replace(COST, mlp_s_per_row=0.0).step_rows(MLP, BUDGET, most) == []


def test_warm_steps_runs_the_slices_at_their_row_counts(model: LlamaModel) -> None:
    model.warm_steps([1, 32], [1, 32], COST.step_rows(MLP, BUDGET, 2048))
    plain = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    plain.warm_steps([1], [1], [1, 32])  # no slices: nothing to warm for them
