"""The machine's slow wander in the planner's simulation (engine/sim/errors.py's Drift), fitted from a
pilot's batch logs (engine/planner/measured.py's `wander`), and the real runs' batches charged to the
simulated requests they were (against_serve's `as_simulated`)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from test_sim import COST

from engine.core.batch_log import MeasuredBatch
from engine.model.cost import SeqSpan
from engine.planner.measured import Planned, Wander, wander
from engine.sim.errors import Drift, PredictionError, TrueSpeed


def _corr(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def test_the_drift_wanders_with_its_sigma_and_forgets_itself_over_its_time() -> None:
    """Read every 0.2 s (its stretches at 2 s), the log of the drift has its sigma, median one, and
    correlates e^-0.1 with the next stretch and e^-1 with the one 2 s on; it holds within a stretch."""
    drift = Drift(0.2, 2.0, 10.0, random.Random(3))
    logs = [math.log(drift.at(10.0 + 0.2 * k + 0.1)) for k in range(60000)]
    assert statistics.pstdev(logs) == pytest.approx(0.2, rel=0.1)
    assert statistics.median(logs) == pytest.approx(0.0, abs=0.02)
    assert _corr(logs[:-1], logs[1:]) == pytest.approx(math.exp(-0.1), abs=0.02)
    assert _corr(logs[:-10], logs[10:]) == pytest.approx(math.exp(-1), abs=0.05)
    assert drift.at(10.21) == drift.at(10.39) != drift.at(10.41)
    assert drift.next_change_after(10.25) == pytest.approx(10.4)
    assert drift.at(3.0) == drift.at(10.0)  # before the run: its first stretch


def test_a_machine_with_drift_keeps_each_batch_s_own_draws_and_changes_between_stretches() -> None:
    """The drift draws from its own stream: each batch's own factors are the ones drawn without it; the
    machine's factor changes at the drift's stretches (and, with none, never)."""
    plain = PredictionError(noise=0.3, noise_mean_one=False)
    wandering = PredictionError(noise=0.3, noise_mean_one=False, drift=0.2, drift_s=1.0)
    a, b = plain.machine(30.0, seed=5), wandering.machine(30.0, seed=5)
    assert [a.batch_factor() for _ in range(50)] == [b.batch_factor() for _ in range(50)]
    assert a.at(7.0) == 1.0 and a.next_change_after(7.0) == math.inf
    assert b.next_change_after(7.05) == pytest.approx(7.1)
    assert len({b.at(0.1 * k + 0.05) for k in range(100)}) > 90
    assert isinstance(b, TrueSpeed)


def _worker_runs(drift: float, tau_s: float, batch: float, runs: int = 12, seed: int = 1) -> list[MeasuredBatch]:
    """Batches of one worker per run, 0.1-0.3 s apart, small ones 3x the profile and large ones 1.5x, each
    with its own lognormal draw and the machine's drift where it began; each run at a level of its own."""
    rng = random.Random(seed)
    out = []
    for r in range(runs):
        wandering = Drift(drift, tau_s, 0.0, random.Random(seed * 100 + r)) if drift else None
        level, t = rng.gauss(0.0, 0.2), 1000.0 * r
        for i in range(250):
            small = i % 2 == 0
            base = 0.01 if small else 0.5
            log = level + rng.gauss(0.0, batch) + (math.log(wandering.at(t - 1000.0 * r)) if wandering else 0.0)
            exec_s = base * (3.0 if small else 1.5) * math.exp(log)
            out.append(MeasuredBatch([f"r{r}-{i}"], base, exec_s, 1.0, 100 if small else 4000, t + 0.05, t))
            t += rng.uniform(0.1, 0.3)
    return out


def test_a_wander_fitted_from_batches_gives_back_the_drift_that_made_them() -> None:
    """Batches made with a drift of 0.15 over 1.5 s beside a batch sigma of 0.1 (and a level per run,
    which is not drift): the fit finds about those; made with no drift, it finds next to none."""
    fitted = wander(_worker_runs(0.15, 1.5, 0.1))
    assert fitted is not None
    assert fitted.drift == pytest.approx(0.15, abs=0.04) and fitted.batch == pytest.approx(0.1, abs=0.03)
    assert 0.75 <= fitted.drift_s <= 3.0
    still = wander(_worker_runs(0.0, 1.5, 0.15, seed=2))
    assert still is not None and still.drift < 0.05 and still.batch == pytest.approx(0.15, abs=0.02)
    assert wander([MeasuredBatch(["x"], 0.01, 0.03, 1.0)]) is None  # no sizes, no times


def test_two_workers_logs_are_read_as_two_runs() -> None:
    """A second worker's file begins back in time: its batches are not paired with the first's (which,
    here, ran at a speed of their own, so pairing them would read as drift)."""
    one = [b._replace(exec_s=b.exec_s * 2) for b in _worker_runs(0.0, 1.0, 0.05, runs=1, seed=3)]
    other = _worker_runs(0.0, 1.0, 0.05, runs=1, seed=4)
    fitted = wander(one + other)
    assert fitted is not None and fitted.drift < 0.03 and fitted.batch == pytest.approx(0.05, abs=0.01)


def test_a_planner_with_drift_runs_several_draws_that_differ() -> None:
    """Drift alone, no batch noise, is drawn too: NOISE_DRAWS runs, not all alike."""
    from engine.core.config import EngineConfig
    from engine.planner.fleet import NOISE_DRAWS, Planner
    from engine.planner.measured import planned_with
    from loadtest.workload import TraceRequest, Workload

    w = Workload("burst", "test", "fixed", [TraceRequest(0.05 * i, 1500, 1, "interactive") for i in range(40)])
    planner = Planner(w, COST, EngineConfig(prefix_caching=False), 0.9, False)
    planned = planned_with(COST, {}, Wander(0.0, 0.5, 1.0))
    assert planned == Planned(COST, drift=0.5, drift_s=1.0)
    planner.use(planned)
    planner.evaluate("fcfs", 1, stop_early=False)
    assert planner.sims == NOISE_DRAWS
    ttfts = [tuple(r.ttft for r in planner._run("fcfs", 1, seed, False, None)[0]) for seed in range(3)]  # type: ignore[index]
    assert len(set(ttfts)) == 3


def test_the_real_runs_batches_are_charged_to_the_simulated_requests_they_ran() -> None:
    """The workers log the client's x-request-id (peer-<ns>-<index>); the simulation names the same
    arrivals w<index>: renamed, every request's own measured factor is found, not the median's."""
    from engine.bench.planner_validation.against_serve import as_simulated
    from engine.core.request import Request
    from engine.sim.oracle import ExactCosts
    from loadtest.peer.client import arrival_index, request_id

    assert arrival_index(request_id(17)) == 17 and arrival_index("chatcmpl-9") is None
    reqs = [Request(request_id=f"w{i}", prompt_token_ids=[1] * 10) for i in range(3)]
    logged = [MeasuredBatch([request_id(i)], 0.1, 0.1 * (i + 1), 1.0, 10) for i in range(3)]
    logged.append(MeasuredBatch(["someone-else"], 0.1, 0.5, 1.0, 10))
    exact = ExactCosts.from_batches(COST, as_simulated(logged, reqs))
    assert [exact.factor(r) for r in reqs] == pytest.approx([1.0, 2.0, 3.0])
    assert ExactCosts.from_batches(COST, logged).factor(reqs[0]) == exact.default  # as it was: none found


def test_the_measured_costs_are_each_run_replayed_alone_then_their_median() -> None:
    """Three runs whose requests all ran 1x, 2x and 6x the profile: the column is the median of the three
    replays (the 2x run's), not one replay of the three pooled (each request at its mean, 3x)."""
    from engine.bench.planner_validation.against_serve import as_simulated, replayed_runs
    from engine.core.config import EngineConfig
    from engine.planner.fleet import Planner
    from engine.sim.oracle import ExactCosts
    from loadtest.peer.client import request_id
    from loadtest.workload import TraceRequest, Workload

    w = Workload("burst", "test", "fixed", [TraceRequest(0.025 * i, 200, 1, "interactive") for i in range(40)])
    planner = Planner(w, COST, EngineConfig(prefix_caching=False), 0.9, False)
    reqs = planner.requests()
    base = [COST.prefill_s([SeqSpan(0, 200)])] * len(reqs)

    def run(factor: float) -> list[MeasuredBatch]:
        return [MeasuredBatch([request_id(i)], b, factor * b, 1.0, 200) for i, b in enumerate(base)]

    def alone(factor: float) -> dict:
        exact = ExactCosts.from_batches(COST, as_simulated(run(factor), reqs))
        return planner.evaluate("fcfs", 1, stop_early=False, exact=exact)

    runs = [run(1.0), run(2.0), run(6.0)]
    median = replayed_runs(planner, "fcfs", 1, COST, runs, reqs)
    assert [x["attainment"] for x in median["runs"]] == [alone(f)["attainment"] for f in (1.0, 2.0, 6.0)]
    assert median["attainment"] == alone(2.0)["attainment"] != alone(3.0)["attainment"]


def test_a_drift_needs_a_time_to_forget_itself_over() -> None:
    with pytest.raises(ValueError, match="drift_s"):
        PredictionError(drift=0.2, drift_s=0.0)
    assert PredictionError(drift=0.0, drift_s=0.0).machine(10.0).at(3.0) == 1.0


def test_the_plan_s_speed_is_checked_on_the_runs_own_batch_sizes() -> None:
    """The pilot ran mostly short batches (3x the cost model), the runs mostly long ones (1.5x), at the
    same speed per size: over requests the pilot reads twice as slow; on the runs' batches the plan's
    speed is theirs. Runs whose long batches ran faster are told, by as much as their time says."""
    from engine.bench.planner_validation.against_serve import planned_over_real
    from engine.sim.oracle import at_speed

    def batches(short: int, long: int, long_factor: float = 1.5) -> list[MeasuredBatch]:
        return ([MeasuredBatch([f"s{i}"], 0.01, 0.03, 1.0, 100) for i in range(short)]
                + [MeasuredBatch([f"l{i}"], 0.1, 0.1 * long_factor, 1.0, 1500) for i in range(long)])

    pilot, runs = batches(10, 2), batches(2, 10)
    planned = at_speed(COST, pilot, 3.0)
    assert planned_over_real(planned, runs) == pytest.approx(1.0)
    faster = batches(2, 10, long_factor=1.2)  # its time: 2 x 0.03 + 10 x 0.12 s; at the plan's, 0.06 + 1.5
    assert planned_over_real(planned, faster) == pytest.approx(1.56 / 1.26)
    assert planned_over_real(planned, []) is None


def test_the_command_says_how_far_the_plan_s_speed_was_from_each_fleet_s_runs() -> None:
    from engine.bench.planner_validation.report import pilot_against_runs

    doc = {"against_serve": [{"policy": "chunked:2048", "workers": 1, "planned_over_real_s": 1.17},
                             {"policy": "chunked:2048", "workers": 2, "planned_over_real_s": 0.96},
                             {"policy": "flowprefill", "workers": 1}]}
    lines = pilot_against_runs(doc)
    assert len(lines) == 3 and "take 17 % longer than they did" in lines[1] and "4 % less time" in lines[2]
    assert pilot_against_runs({"against_serve": [{"policy": "fcfs", "workers": 1}]}) == []


def test_each_pilot_run_s_speed_against_the_pooled_is_read_at_the_same_batch_sizes() -> None:
    """Two pilot runs of one mix, one twice as slow: 2/3 and 4/3 of their pooled time per batch. Two runs at
    the same speed per size but of different mixes (short batches 3x the cost model, long ones 1.5x):
    both 1.0, not the 2x a median factor over their batches would read. One run: nothing to compare."""
    from engine.planner.measured import relative_speeds

    def run(short: int, long: int, slower: float = 1.0) -> list[MeasuredBatch]:
        return ([MeasuredBatch([f"s{i}"], 0.01, 0.03 * slower, 1.0, 100) for i in range(short)]
                + [MeasuredBatch([f"l{i}"], 0.1, 0.15 * slower, 1.0, 1500) for i in range(long)])

    assert relative_speeds([run(5, 5), run(5, 5, slower=2.0)]) == pytest.approx([2 / 3, 4 / 3])
    assert relative_speeds([run(10, 2), run(2, 10)]) == pytest.approx([1.0, 1.0])
    assert relative_speeds([run(5, 5)]) is None
