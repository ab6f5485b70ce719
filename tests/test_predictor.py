"""The TTFT predictor's online correction: learned per batch size class, from executed batches."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.model.plan import SIZE_CLASSES, OpCost, SeqSpan, plan_prefill, size_class
from engine.request import SamplingParams

BUDGET = 0.002


def cost_model() -> OpCost:
    return OpCost(ModelConfig(), attn_in_s_per_row=2e-6, ffn_s_per_row=1.2e-5, attn_s_per_pair=7e-8)


def test_size_classes() -> None:
    assert [size_class(n) for n in (1, 128, 129, 512, 2048, 2049, 8192, 8193, 100_000)] == [0, 0, 1, 1, 2, 3, 3, 4, 4]
    assert len(cost_model().class_scale) == len(SIZE_CLASSES) + 1


def test_short_batches_correct_only_their_own_class() -> None:
    """Short batches that beat the line (CUDA graphs) must not make a long batch's steps bigger:
    one shared correction sized 8K-token steps by 32-token batches' speed and broke the budget."""
    cost = cost_model()
    long, short = [SeqSpan(0, 8000)], [SeqSpan(0, 32)]
    long_s, short_s = cost.prefill_s(long), cost.prefill_s(short)
    long_plan, short_plan = plan_prefill(cost, long, BUDGET), plan_prefill(cost, short, BUDGET)
    for _ in range(10):
        cost.observe(32, short_plan.base_cost, short_plan.base_cost / 3)
    assert cost.prefill_s(short) == pytest.approx(short_s / 3)
    assert plan_prefill(cost, short, BUDGET).total_cost == pytest.approx(short_plan.total_cost / 3)
    assert cost.prefill_s(long) == long_s
    assert list(plan_prefill(cost, long, BUDGET)) == list(long_plan)

    # A long batch 25 % slower than predicted: its class learns it (a running mean at first), its
    # steps shrink so that each is still predicted within the budget.
    cost.observe(8000, long_plan.base_cost, 1.25 * long_plan.base_cost)
    assert cost.prefill_s(long) == pytest.approx(1.25 * long_s)
    slower = plan_prefill(cost, long, BUDGET)
    assert len(slower) > len(long_plan)
    assert max(s.cost for s in slower) <= BUDGET
    assert slower.base_cost == pytest.approx(slower.total_cost / 1.25)
    # A class not measured yet borrows its nearest measured class's correction, only to slow down.
    assert cost.prefill_s([SeqSpan(0, 3000)]) == pytest.approx(1.25 * cost_model().prefill_s([SeqSpan(0, 3000)]))
    assert cost.prefill_s([SeqSpan(0, 200)]) == cost_model().prefill_s([SeqSpan(0, 200)])  # near 32's 1/3
    # then an exponential average, bounded
    for _ in range(100):
        cost.observe(8000, long_plan.base_cost, 1e6)
    assert cost.class_scale[size_class(8000)] == 20.0
    assert cost.class_scale[size_class(32)] == pytest.approx(1 / 3)


def test_the_engine_corrects_the_class_of_each_finished_batch() -> None:
    from engine.engine import Engine

    engine = Engine(EngineConfig(), policy="flowprefill").start()
    try:
        engine.generate([[65] * 600], SamplingParams(max_tokens=1))
        engine.generate([[66] * 40], SamplingParams(max_tokens=1))
        engine.generate([[67] * 700], SamplingParams(max_tokens=1))
        observed = engine.cost.class_observations
    finally:
        engine.shutdown()
    assert observed == [1, 0, 2, 0, 0]
    learned = engine.cost.class_scale
    assert learned[1] == learned[3] == learned[4] == 1.0 and learned[0] != 1.0 and learned[2] != 1.0


def test_corrections_converge_and_stay_with_the_model_that_learned_them() -> None:
    cost = cost_model()
    spans = [SeqSpan(0, 3000)]
    calibrated = cost.prefill_s(spans)
    for _ in range(30):  # this device runs such batches at 0.6 of the calibrated time
        plan = plan_prefill(cost, spans, BUDGET)
        cost.observe(3000, plan.base_cost, 0.6 * plan.base_cost)
    assert cost.factor(3000) == pytest.approx(0.6)
    assert cost.prefill_s(spans) == pytest.approx(0.6 * calibrated, rel=1e-3)
    # A batch's view carries its correction in `scale` and nothing else: it neither applies it twice
    # nor learns into the model it came from.
    view = cost.for_batch(3000)
    assert view.prefill_s(spans) == pytest.approx(cost.prefill_s(spans))
    view.observe(3000, 1.0, 5.0)
    assert cost.factor(3000) == pytest.approx(0.6) and cost.class_observations[size_class(3000)] == 30
