"""The TTFT predictor's online correction: learned per batch size class, from executed batches."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.model.cost import SIZE_CLASSES, OpCost, SeqSpan, size_class
from engine.model.plan import plan_prefill

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
    from engine.core.engine import Engine

    engine = Engine(EngineConfig(), policy="flowprefill").start()
    try:
        engine.generate([[65] * 600], SamplingParams(max_tokens=1))
        engine.generate([[66] * 40], SamplingParams(max_tokens=1))
        engine.generate([[67] * 700], SamplingParams(max_tokens=1))
        observed = engine.cost.class_observations
    finally:
        engine.shutdown()
    # (a batch reports its progress every 50 ms of measured time as well as at its end: a class may
    # count more observations than batches, never one it did not run)
    assert [n > 0 for n in observed] == [True, False, True, False, False]
    assert observed[0] >= 1 and observed[2] >= 2
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


def test_the_correction_follows_a_3x_slowdown_within_a_few_batches() -> None:
    """Batches of every size, then the machine runs everything 3x slower: whatever size runs next,
    each class's prediction is within 10 % of the truth after at most 3 batches of any size (with one
    correction per size class alone, a class waited for ten of its own)."""
    cost = cost_model()
    sizes = [32, 400, 1500, 3000, 100, 700]

    def run(tokens: int, slow: float) -> float:
        """One batch, its progress reported every 50 ms as the engine does; its error when it formed."""
        plan = plan_prefill(cost, [SeqSpan(0, tokens)], BUDGET)
        chunks = max(1, round(slow * plan.base_cost / 0.05))
        for _ in range(chunks):
            cost.observe(tokens, plan.base_cost / chunks, slow * plan.base_cost / chunks)
        return plan.total_cost / (slow * plan.base_cost) - 1

    for _ in range(3):
        for n in sizes:
            run(n, 1.0)
    assert all(abs(cost.factor(n) - 1) < 0.01 for n in sizes)
    errors = [run(n, 3.0) for n in sizes]
    assert errors[0] == pytest.approx(-2 / 3, abs=0.01)  # the first batch after the step: 3x optimistic
    assert all(abs(e) < 0.1 for e in errors[3:]), errors
    assert all(cost.factor(n) == pytest.approx(3.0, rel=0.1) for n in sizes)


def test_a_running_batch_corrects_its_class_on_its_way() -> None:
    """A long batch 3x slower than predicted: its class knows it from its first progress report, so a
    request ranked against it while it runs sees the truth (PrefillBatch.take_progress)."""
    from engine.core.prefill import PrefillBatch
    from engine.sim.simulator import VirtualRun

    cost = cost_model()
    spans = [SeqSpan(0, 6000)]
    plan = plan_prefill(cost, spans, BUDGET)
    batch = PrefillBatch([], spans, plan, VirtualRun(len(plan)))  # type: ignore[arg-type]
    for _ in range(len(plan) // 10):
        batch.advance()
    batch.exec_s = 3 * plan.cost_before(batch.next_step)
    base, measured = batch.take_progress()
    assert base == pytest.approx(plan.cost_before(batch.next_step)) and measured == pytest.approx(3 * base)
    assert batch.take_progress() == (0.0, 0.0)  # nothing new since
    cost.observe(batch.num_tokens, base, measured)
    assert cost.prefill_s(spans) == pytest.approx(3 * cost_model().prefill_s(spans), rel=0.01)
    assert batch.remaining_base_s == pytest.approx(plan.base_cost - base)


def test_the_engine_learns_from_the_running_batch() -> None:
    """A real engine tells the cost model what a running batch measured every 50 ms, not only when it
    ends: a batch made to take at least 150 ms (each step spins twice its own time) reports 3 times."""
    import time

    from engine.core.engine import Engine
    from engine.model.cost import size_class

    engine = Engine(EngineConfig(), policy="flowprefill")
    prefill = engine.model.prefill
    seen: list[int] = []

    def slowed(*args, **kwargs):  # the model's own generator, its steps stretched
        steps = prefill(*args, **kwargs)
        while True:
            t0 = time.perf_counter()
            try:
                i = next(steps)
            except StopIteration as stop:
                seen.append(engine.cost.class_observations[k])  # before the batch's completion reports
                return stop.value
            end = time.perf_counter() + 2 * (time.perf_counter() - t0)
            while time.perf_counter() < end:
                pass
            yield i

    engine.model.prefill = slowed
    k = size_class(1500)
    try:
        engine.start()
        engine.generate([[65] * 1500], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        engine.generate([[66] * 1500], SamplingParams(max_tokens=1))
        took = time.perf_counter() - t0
    finally:
        engine.shutdown()
    if took < 0.15:
        pytest.skip(f"this machine prefilled 1500 tokens 3x slowed in {took:.3f} s: too fast to report mid-way")
    assert seen[1] - seen[0] >= 3 - 1  # reported while it ran, then once more at its end


def test_one_stretched_short_batch_does_not_swing_every_prediction() -> None:
    """A 13 ms batch stretched to 200 ms by a pause reads 15x; one such measurement moves the machine's
    factor by at most MAX_SURPRISE's worth of its weight (here the whole-batch floor, 0.2), so the long
    classes' predictions do not follow it to a refusal."""
    from engine.model.cost import MAX_SURPRISE

    cost = cost_model()
    for n in (100, 100, 100, 6000, 6000, 6000):  # each class's own way first
        plan = plan_prefill(cost, [SeqSpan(0, n)], BUDGET)
        cost.observe(n, plan.base_cost, plan.base_cost)
    before = cost.factor(6000)
    plan = plan_prefill(cost, [SeqSpan(0, 100)], BUDGET)
    cost.observe(100, plan.base_cost, 15 * plan.base_cost)
    assert cost.factor(6000) == pytest.approx(before * (1 + 0.2 * (MAX_SURPRISE - 1)))
    assert cost.factor(6000) < 1.7 * before  # unbounded: 1 + 0.2 * 14 = 3.8x


def test_the_prediction_of_a_prefill_is_its_plan() -> None:
    """What the scheduler predicts for a queued prompt is what the plan it will run costs: short
    prompts exactly (each operator one step), long ones within a few percent (the split's blocks).
    Counting an empty prefix tile and the split's steps over the whole prefill predicted a 16-token
    prefill 16 % over its plan at 88 us a step."""
    from dataclasses import replace

    cost = replace(cost_model(), step_overhead_s=88e-6, row_step_floor_s=144e-6, budget_s=BUDGET)
    for spans in ([SeqSpan(0, 16)], [SeqSpan(0, 128)], [SeqSpan(0, 40), SeqSpan(0, 24)], [SeqSpan(512, 16)]):
        planned = plan_prefill(cost, spans, BUDGET, last_token_only=True).total_cost
        assert cost.prefill_s(spans) == pytest.approx(planned)
    for n in (2048, 8192):
        plan = plan_prefill(cost, [SeqSpan(0, n)], BUDGET, last_token_only=True)
        assert cost.prefill_s([SeqSpan(0, n)]) == pytest.approx(plan.total_cost, rel=0.05)


def test_a_cpu_calibration_does_not_count_time_its_thread_was_off_the_core() -> None:
    """Calibration times on the thread's CPU clock: a start-up beside a busy process on its core (the
    other worker of `serve --workers 2` loading, a peer server compiling) must not write a profile
    that is slow by the time the scheduler gave the other process. A sleep stands in for that time:
    by the wall this operator took 20 ms, on the core nothing."""
    import time

    import torch

    from engine.model.calibration import _best_time

    cpu = torch.device("cpu")
    assert _best_time(lambda: time.sleep(0.02), cpu, repeat=3) < 0.005
    spin_s = _best_time(lambda: sum(range(200_000)), cpu, repeat=3)  # real work still counts
    assert spin_s > 0.0005


def test_the_host_time_per_batch_is_learned_from_measured_gaps_and_shrugs_off_a_pause() -> None:
    cost = cost_model()
    for _ in range(40):
        cost.observe_host(0.004)
    assert cost.batch_host_s == pytest.approx(0.004, rel=0.02)
    cost.observe_host(0.5)  # one stall: counted as at most 4x the average plus a millisecond
    assert cost.batch_host_s < 0.006
    cost.observe_host(-1.0)  # no gap measured
    assert cost.batch_host_s < 0.006
    spans = [SeqSpan(0, 300)]
    assert cost.batch_s(spans) == pytest.approx(cost.prefill_s(spans) + cost.batch_host_s)
