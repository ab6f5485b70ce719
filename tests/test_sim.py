"""Simulator: deterministic for a seed, bounded by ideal preemption, and in agreement with the
real engine on the same small workload."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace

import pytest

from engine.core.config import EngineConfig, ModelConfig
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import make_policy
from engine.model.cost import OpCost
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim import ExactCosts, SimConfig, simulate
from engine.sim.costs import analytical
from engine.sim.oracle import BatchCostRecorder
from loadtest.workload import poisson

COST = OpCost(ModelConfig(), attn_in_s_per_row=2e-6, ffn_s_per_row=1.2e-5, attn_s_per_pair=7e-8)


def requests(spec: list[tuple[float, int, str]], t0: float = 0.0, tokens: bool = False) -> list[Request]:
    return [Request.for_class(DEFAULT_CLASSES[c], request_id=f"r{i}",
                              prompt_token_ids=[(i + j) % 200 + 32 for j in range(n)] if tokens else [0] * n,
                              sampling=SamplingParams(max_tokens=1), arrival_time=t0 + t)
            for i, (t, n, c) in enumerate(spec)]


def trace(rate: float, n: int = 300) -> list[tuple[float, int, str]]:
    return [(r.arrival_s, r.input_tokens, r.slo_class) for r in poisson(rate, n, seed=3).requests]


def test_deterministic_for_a_seed() -> None:
    runs = []
    for _ in range(2):
        reqs = requests(trace(3.0, 100))
        pre = simulate(reqs, make_policy("flowprefill"), COST, SimConfig(noise=0.2, seed=7))
        runs.append((pre, [r.times.first_token_time for r in reqs]))
    assert runs[0] == runs[1]
    other = requests(trace(3.0, 100))
    simulate(other, make_policy("flowprefill"), COST, SimConfig(noise=0.2, seed=8))
    assert [r.times.first_token_time for r in other] != runs[0][1]


def test_ideal_preemption_bounds_the_real_mechanism() -> None:
    def attainment(ideal: bool, budget: float | None) -> float:
        reqs = requests(trace(4.0))
        simulate(reqs, make_policy("flowprefill"), COST, SimConfig(step_budget_s=budget, ideal=ideal))
        return sum(r.ttft <= r.ttft_target_s for r in reqs) / len(reqs)

    ideal, split, coarse = attainment(True, 0.002), attainment(False, 0.002), attainment(False, None)
    assert ideal >= split >= coarse
    assert ideal - split < 0.02  # bounded stop latency loses (almost) nothing


def test_flowprefill_beats_baselines_in_simulation() -> None:
    def attainment(policy: str) -> float:
        reqs = requests(trace(3.0))
        simulate(reqs, make_policy(policy), COST, SimConfig())
        return sum(r.ttft <= r.ttft_target_s for r in reqs) / len(reqs)

    fp = attainment("flowprefill")
    assert fp > attainment("fcfs") and fp > attainment("chunked:8192")


def test_gpu_cost_model_is_sane() -> None:
    cost = analytical("llama-3.1-8b", "h100")
    # ~16 GFLOP per token for an 8B model: a 2K prompt takes tens of milliseconds on an H100.
    from engine.model.cost import SeqSpan

    t = cost.prefill_s([SeqSpan(0, 2048)])
    assert 0.02 < t < 0.2
    assert analytical("llama-3.1-8b", "a100").prefill_s([SeqSpan(0, 2048)]) > t
    with pytest.raises(ValueError):
        analytical("gpt-5", "h100")


def test_the_host_s_time_per_batch_delays_the_next_batch_not_the_correction() -> None:
    """OpCost.batch_host_s: after a batch's last step the host finishes it (first token, next decision)
    before the next batch starts; the batch's measured time, which the correction learns from, is its
    steps' alone; the ideal bound charges none. The GPU cost models carry it (measured on an H200)."""
    host = 0.004
    spec = [(0.0, 600, "standard"), (0.0, 600, "standard")]

    def first_tokens(cost: OpCost, ideal: bool = False) -> list[float]:
        reqs = requests(spec)
        simulate(reqs, make_policy("fcfs"), cost, SimConfig(max_batch_tokens=600, ideal=ideal))
        return sorted(r.times.first_token_time for r in reqs)

    base, charged = first_tokens(COST), first_tokens(replace(COST, batch_host_s=host))
    step_s = base[0]  # one 600-token prompt's steps
    assert step_s > 0.01 and base[1] == pytest.approx(2 * step_s)
    assert charged[0] == pytest.approx(base[0] + host) and charged[1] == pytest.approx(base[1] + 2 * host)
    assert first_tokens(replace(COST, batch_host_s=host), ideal=True) == pytest.approx(base)

    from engine.sim.simulator import BatchRecord

    records: list[BatchRecord] = []
    simulate(requests(spec), make_policy("fcfs"), replace(COST, batch_host_s=host), SimConfig(max_batch_tokens=600),
             batches=records)
    assert [r.measured_s for r in records] == pytest.approx([step_s, step_s])
    assert analytical("llama-3.1-8b", "h200").batch_host_s > 0


def _real_and_simulated(engine_cfg: EngineConfig) -> tuple[list[Request], list[Request], OpCost, list, list]:
    """One long prefill and three later arrivals on a real engine, and the same arrivals simulated with the
    cost model as the engine had it before them: (real, simulated, that model, the batches measured,
    the arrivals)."""
    from engine.core.engine import Engine
    from engine.model.cost import SeqSpan

    engine = Engine(engine_cfg, policy="flowprefill")
    measured = BatchCostRecorder()
    engine.observers.append(measured)
    engine.start()
    try:
        # Arrivals placed by the engine's own prediction of the long prefill, refined by one run of
        # it, so the decisions do not hinge on how fast this shared machine happens to be today.
        engine.generate([[65] * 3000], SamplingParams(max_tokens=1))
        long_s = engine.cost.prefill_s([SeqSpan(0, 3000)])
        spec = [(0.0, 3000, "batch"), (0.1 * long_s, 200, "interactive"), (0.25 * long_s, 150, "interactive"),
                (0.5 * long_s, 600, "relaxed")]
        # The simulator's scheduler corrects its cost model online as the engine's does: both start
        # from the model as it stands before these arrivals.
        cost = copy.deepcopy(engine.cost)
        t0 = time.monotonic() + 0.2
        real = requests(spec, t0, tokens=True)
        done = threading.Semaphore(0)
        for r in real:
            r.sink = lambda out: out.finish_reason and done.release()
        for r in real:
            time.sleep(max(0.0, r.arrival_time - time.monotonic()))
            engine.add_request(r)
        for _ in real:
            assert done.acquire(timeout=120)
    finally:
        engine.shutdown()
    sim = requests(spec)
    simulate(sim, make_policy("flowprefill"), cost, SimConfig())
    return real, sim, cost, measured.batches, spec


def _order(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in sorted(reqs, key=lambda r: r.times.first_token_time)]


def _disagreement(real: list[Request], sim: list[Request]) -> str | None:
    """How the real run's decisions differ from the simulated ones (None: they agree)."""
    if not _order(real) == _order(sim) == ["r1", "r2", "r3", "r0"]:
        return f"first tokens in order {_order(real)} (real) and {_order(sim)} (simulated)"
    if not len(real[0].times.suspensions) == len(sim[0].times.suspensions) == 3:
        return f"{len(real[0].times.suspensions)} suspensions (real) and {len(sim[0].times.suspensions)} (simulated)"
    for a, b in zip(real, sim, strict=True):  # TTFTs of the same order (the machine is shared and noisy)
        if not b.ttft / 2.5 - 0.1 < a.ttft < b.ttft * 2.5 + 0.1:
            return f"{a.request_id}: TTFT {a.ttft:.3f} s (real) and {b.ttft:.3f} s (simulated)"
    return None


def test_simulator_agrees_with_real_engine() -> None:
    """The same scheduler code, fed the same arrivals, makes the same decisions in both worlds. The
    real run shares two cores with the other tests (pytest -n 2): a burst there once stretched a stop to
    14 ms, an arrival met a short request still running, and the long one was suspended twice, not three
    times. Such a run is tried again, up to three times; a scheduler that decides otherwise fails all."""
    seen = []
    for _ in range(3):
        real, sim, cost, batches, spec = _real_and_simulated(EngineConfig())
        problem = _disagreement(real, sim)
        if problem is None:
            break
        seen.append(problem)
    assert problem is None, seen

    # The ideal bound replays what each batch measured, with zero stop latency and exact prediction:
    # the same decisions, and no request later than it really was (beyond timer resolution).
    base = replace(cost, scale=1.0)
    exact = ExactCosts.from_batches(base, [b for b in batches if b[0][0].startswith("r")])
    assert set(exact.factors) == {"r0", "r1", "r2", "r3"}
    ideal = requests(spec)
    simulate(ideal, make_policy("flowprefill"), base, SimConfig(ideal=True), exact=exact)
    assert _order(ideal) == _order(real)
    for a, b in zip(real, ideal, strict=True):
        assert b.ttft <= a.ttft * 1.02 + 0.002, (a.request_id, a.ttft, b.ttft)


def test_exact_costs_time_and_predict_each_request_by_its_measured_factor() -> None:
    spec = [(0.0, 3000, "batch"), (0.05, 200, "interactive"), (0.3, 1500, "standard")]
    uniform = ExactCosts(COST, {"r0": 1.5, "r1": 1.5, "r2": 1.5})
    a, b = requests(spec), requests(spec)
    simulate(a, make_policy("flowprefill"), COST, SimConfig(ideal=True), exact=uniform)
    simulate(b, make_policy("flowprefill"), replace(COST, scale=1.5), SimConfig(ideal=True))
    assert [r.times.first_token_time for r in a] == pytest.approx([r.times.first_token_time for r in b])

    # A request measured twice as slow takes twice as long alone, and is predicted so on arrival.
    ttft = {}
    for factor in (1.0, 2.0):
        alone = requests([(0.0, 1500, "standard")])
        simulate(alone, make_policy("flowprefill"), COST, SimConfig(ideal=True), exact=ExactCosts(COST, {"r0": factor}))
        ttft[factor] = alone[0].ttft
    assert ttft[2.0] == pytest.approx(2 * ttft[1.0], rel=0.05)
    from engine.model.cost import SeqSpan

    hopeless = requests([(0.0, 1500, "standard")])
    hopeless[0].deadline = hopeless[0].arrival_time + 1.5 * COST.prefill_s([SeqSpan(0, 1500)])
    simulate(hopeless, make_policy("flowprefill"), COST, SimConfig(), exact=ExactCosts(COST, {"r0": 2.0}))
    assert hopeless[0].predicted_miss


def test_exact_costs_from_batches_sum_a_chunked_request() -> None:
    exact = ExactCosts.from_batches(COST, [(["a", "b"], 0.1, 0.2), (["a"], 0.1, 0.1)])
    assert exact.factors == pytest.approx({"a": 1.5, "b": 2.0})
    assert exact.default == pytest.approx(1.75)


def test_the_bound_plans_as_the_engine_did_and_charges_what_it_measured() -> None:
    """A request the engine planned at its correction (1.0) and measured 2x slow takes exactly what
    it measured in the bound: replanned at 2x, its steps would halve and each adds an overhead."""
    from engine.model.cost import SeqSpan
    from engine.model.plan import plan_prefill
    from engine.sim.oracle import MeasuredBatch

    cost = replace(COST, step_overhead_s=88e-6)
    planned = plan_prefill(cost, [SeqSpan(0, 1500)], 0.002, last_token_only=True)
    exact = ExactCosts.from_batches(cost, [MeasuredBatch(["r0"], planned.base_cost, 2 * planned.base_cost, 1.0)])
    alone = requests([(0.0, 1500, "standard")])
    simulate(alone, make_policy("flowprefill"), cost, SimConfig(ideal=True), exact=exact)
    assert alone[0].ttft == pytest.approx(2 * planned.base_cost, rel=1e-9)


def test_prediction_error_levels_parse() -> None:
    from engine.sim.errors import DEFAULT_LEVELS, PredictionError

    assert PredictionError.parse("noise:0.5").noise == 0.5
    assert PredictionError.parse("bias:0.2").bias == 0.2
    step = PredictionError.parse("slowdown:3@0.25")
    assert (step.slowdown, step.slowdown_at) == (3.0, 0.25)
    assert PredictionError.parse("none") == PredictionError()
    assert len([PredictionError.parse(x) for x in DEFAULT_LEVELS.split(",")]) == 9
    for bad in ("noise", "bias:0", "slowdown:-2", "slowdown:2@1.5", "jitter:1", "none:1", "noise:x"):
        with pytest.raises(ValueError, match="prediction error"):
            PredictionError.parse(bad)


def test_a_biased_predictor_is_corrected_from_the_first_batch() -> None:
    """Five times optimistic: the first batch of a size is predicted five times short, the ones after
    within a few percent; the caller's cost model is left as it was."""
    from engine.sim.errors import PredictionError
    from engine.sim.simulator import BatchRecord

    given = replace(COST)
    log: list[BatchRecord] = []
    reqs = requests(trace(2.0, 100))
    simulate(reqs, make_policy("flowprefill"), given, SimConfig(error=PredictionError.parse("bias:0.2")), batches=log)
    assert log[0].measured_s == pytest.approx(5 * log[0].predicted_s, rel=0.01)
    assert all(abs(b.measured_s / b.predicted_s - 1) < 0.05 for b in log[len(log) // 2:])
    assert given == COST and given.machine == 1.0


def test_after_a_slowdown_step_predictions_follow_within_a_few_batches() -> None:
    from engine.sim.errors import PredictionError
    from engine.sim.simulator import BatchRecord

    log: list[BatchRecord] = []
    reqs = requests(trace(2.0, 200))
    error = PredictionError.parse("slowdown:3@0.5")
    simulate(reqs, make_policy("flowprefill"), COST, SimConfig(error=error), batches=log)
    step_at = 0.5 * max(r.arrival_time for r in reqs)
    after = [b for b in log if b.start >= step_at]
    # (a long batch that ran across the step reported it on its way: the first after are close already; a size
    # class that a run of 9-11K-token batches left unmeasured for a while reads up to 10 % off when it returns)
    assert len(after) > 20 and all(abs(b.measured_s / b.predicted_s - 1) < 0.12 for b in after[2:]), [
        round(b.measured_s / b.predicted_s, 2) for b in after[:10]]
    slowed = sum(b.measured_s for b in after) / sum(b.predicted_s for b in after)
    assert slowed == pytest.approx(1.0, abs=0.1)  # predicted at 3x: without the correction this is 3


def test_noise_is_the_same_for_a_seed_and_mean_one() -> None:
    from engine.sim.errors import PredictionError

    speed = PredictionError.parse("noise:0.5").machine(10.0, seed=3)
    draws = [speed.batch_factor() for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.02)
    again = PredictionError.parse("noise:0.5").machine(10.0, seed=3)
    assert [again.batch_factor() for _ in range(5)] == draws[:5]


def test_the_simulator_steps_its_batches_through_the_engines_loop() -> None:
    """engine/core/prefill.py's `PrefillLoop` is the one loop: in the simulator, as in the engine, each
    batch records the host gap before it, and the scheduler's cost model learns the host time per
    batch from those gaps (here it starts unaware of the 4 ms the virtual host takes)."""
    from engine.sim.simulator import Simulation

    spec = [(0.0, 600, "standard"), (0.0, 600, "standard"), (0.0, 600, "standard")]
    sim = Simulation(requests(spec), make_policy("fcfs"), replace(COST, batch_host_s=0.004),
                     SimConfig(max_batch_tokens=600), None)
    sim.sched.cost.batch_host_s = 0.0
    sim.run()
    assert sim.loop.current is None and sim.preemptions == sim.loop.preemptions == 0
    assert sim.sched.cost.batch_host_s > 0  # two batches waited 4 ms each behind the host
    assert sim.truth.batch_host_s == 0.004  # what the virtual host takes does not learn


def test_a_batch_counts_every_step_its_forward_ran() -> None:
    """A forward may run several steps in one next() (the simulator's fast-forward): the batch counts
    every step up to the one it yields as done."""
    from engine.core.prefill import PrefillBatch
    from engine.model.cost import SeqSpan
    from engine.model.plan import plan_prefill
    from engine.sim.simulator import VirtualRun

    spans = [SeqSpan(0, 600)]
    plan = plan_prefill(COST, spans, 0.002, last_token_only=True)
    run = VirtualRun(len(plan))
    batch = PrefillBatch([], spans, plan, run)  # type: ignore[arg-type]
    run.seek(4)
    assert not batch.advance()
    assert batch.next_step == 5 and batch.remaining_s == pytest.approx(plan.total_cost - plan.cost_before(5))
    assert not batch.advance() and batch.next_step == 6


def test_the_simulator_reserves_kv_as_the_engine_does() -> None:
    """EngineConfig.kv_reservation: `grow` takes a prompt's blocks (and its first answer token's) when its
    batch forms, `full` its whole answer's too: in 8 blocks of 256 two 600-token prompts with
    max_tokens 1,000 fit together only with `grow` (they queue behind a short one, and fill its place)."""
    spec = [(0.0, 100, "standard"), (0.001, 600, "standard"), (0.001, 600, "standard")]

    def first_tokens(reservation: str) -> list[float]:
        reqs = requests(spec)
        for r in reqs:
            r.sampling = SamplingParams(max_tokens=1000)
        simulate(reqs, make_policy("fcfs"), COST, SimConfig(kv_capacity_tokens=2048, kv_reservation=reservation))
        return [r.times.first_token_time - reqs[0].times.first_token_time for r in reqs[1:]]

    grow, full = first_tokens("grow"), first_tokens("full")
    assert grow[0] == grow[1]  # one batch
    assert full[0] < full[1] == pytest.approx(2 * full[0], rel=0.1)  # one after the other


def _answering(spec: list[tuple[float, int, str]], max_tokens: list[int]) -> list[Request]:
    reqs = requests(spec)
    for r, n in zip(reqs, max_tokens, strict=True):
        r.sampling = SamplingParams(max_tokens=n)
    return reqs


def test_the_simulator_decodes_answers_as_the_engine_paces_them() -> None:
    """Answers decode on the virtual device with the engine's `Answers`: back to back while no prefill
    waits, else a step each time the most urgent answer has used half its TBT target, between prefill
    steps; a prefill arriving meanwhile is slowed by them, and the answer's KV is held to its end."""
    cost = replace(COST, decode_s=0.01)
    alone = _answering([(0.0, 100, "standard")], [50])
    simulate(alone, make_policy("flowprefill"), cost, SimConfig())
    a = alone[0]
    assert a.state.done and a.finish_reason == "length" and len(a.output_token_ids) == 50
    assert a.times.finish_time - a.times.first_token_time == pytest.approx(49 * 0.01)

    spec = [(0.0, 100, "standard"), (0.05, 3000, "batch")]
    with_answer = _answering(spec, [200, 1])
    simulate(with_answer, make_policy("flowprefill"), cost, SimConfig())
    prefill_alone = _answering(spec, [1, 1])
    simulate(prefill_alone, make_policy("flowprefill"), cost, SimConfig())
    slowed = with_answer[1].ttft - prefill_alone[1].ttft
    assert slowed > 0.01  # decode steps ran between its prefill steps
    answer = with_answer[0]
    tbt = (answer.times.finish_time - answer.times.first_token_time) / 199
    assert tbt <= answer.tbt_target_s  # and the answer kept its pace
    free = simulate_kv_after(cost)
    assert free == 0  # every block went back


def simulate_kv_after(cost: OpCost) -> int:
    """Blocks still taken once a simulation with answers has ended."""
    from engine.sim.simulator import Simulation

    sim = Simulation(_answering([(0.0, 300, "standard"), (0.01, 300, "standard")], [40, 40]),
                     make_policy("flowprefill"), cost, SimConfig(), None)
    sim.run()
    return sim.kv.num_blocks - sim.kv.num_free_blocks


def test_the_simulator_evicts_answers_when_kv_runs_out_and_recomputes_them() -> None:
    """KV taken as answers grow (`grow`): three 200-token prompts whose answers outgrow 4 blocks of 256
    evict one another (the engine's `Answers.make_room`), and each is recomputed and finished."""
    cost = replace(COST, decode_s=0.001)
    reqs = _answering([(0.0, 200, "standard"), (0.0, 200, "standard"), (0.0, 200, "standard")], [300, 300, 300])
    simulate(reqs, make_policy("flowprefill"), cost, SimConfig(kv_capacity_tokens=1024))
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 300 for r in reqs)
    assert sum(r.times.evictions for r in reqs) >= 1


def test_the_simulator_caches_prefixes_as_the_engine_does() -> None:
    """`prefix_caching`: a trace's block hashes are looked up at arrival; the blocks a prefill wrote are
    findable once it has run, not while it runs (a twin arriving then computes its prompt too)."""
    spec = [(0.0, 2048, "batch"), (0.001, 2048, "batch"), (5.0, 2048, "batch"), (5.0, 2048, "batch")]
    reqs = requests(spec)
    for r in reqs:
        r.block_hashes = [bytes([1]), bytes([2]), bytes([3]), r.request_id.encode()]
    reqs[3].block_hashes = None  # no hashes: a distinct prompt
    cfg = SimConfig(prefix_caching=True, kv_block_size=512)
    simulate(reqs, make_policy("fcfs"), COST, cfg)
    assert [r.cached_tokens for r in reqs] == [0, 0, 3 * 512, 0]
    assert reqs[2].ttft < reqs[0].ttft / 2  # it computed a quarter of its prompt
