"""`flowprefill plan --cost cpu`'s pilot (engine/bench/speed.py): each policy planned at the speed a
short run of its real `serve --workers 1` measured, its workers predicting with the planner's profile."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from test_sim import COST

from engine.core.batch_log import MeasuredBatch
from engine.model.cost import SeqSpan


def test_plan_on_this_cpu_pilots_each_policy_through_a_real_serve_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default for `--cost cpu`: the workload's first requests, at their arrival times, through a real
    `serve --workers 1` of each policy, each policy planned at the speed its own worker logged. Without
    --threads the workers get the planner's thread count, and with `--no-calibrate` they predict with its
    profile: the cache holds one profile and one start-up when the plan is done."""
    from engine.core.batch_log import read, read_workers
    from engine.planner.measured import net_of_serving
    from engine.planner.serve_runs import _sim_id
    from engine.planner.speed import at_measured_speed
    from gateway.cli import main

    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path / "cache"))  # (inherited by serve and its workers)
    out = tmp_path / "out"
    argv = ["plan", "--requests", "12", "--cost", "cpu", "--rate", "8", "--policies", "fcfs,chunked:256",
            "--max-instances", "2", "--pilot", "6", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "plan.json").read_text())
    assert set(doc["pilot"]) == {"fcfs", "chunked:256"} and "engine_pass" not in doc
    (profile,) = (tmp_path / "cache").glob("opcost-*.json")  # the planner's thread count is the workers'
    assert len(json.loads(profile.read_text())["calibrations"]) == 1  # the planner's probe's; none of theirs
    for policy, folder in (("fcfs", "fcfs-w1"), ("chunked:256", "chunked-256-w1")):
        said = doc["pilot"][policy]
        assert said["from"] == "serve --workers 1, the workload's first 6 requests"
        assert said["sent"] == 6 and said["failed"] == 0 and said["logs"] == str(out / "pilot" / folder)
        batches = [b._replace(ids=[_sim_id(rid) for rid in b.ids]) for b in read(out / "pilot" / folder)]
        assert {rid for b in batches for rid in b.ids} == {f"w{i}" for i in range(6)}  # every pilot request
        # the worker's own time per batch, the requests' time outside it as the pilot's client saw it, and
        # the serving side's CPU per request (its worker's /metrics), which its batches are measured net of
        assert said["outside_worker_ms"] > 0 and (said["worker_host_ms"] is None or said["worker_host_ms"] > 0)
        assert said["serving_cpu_ms"] > 0
        assert "idle_wake_ms" in said  # (None here: six requests leave too few batches begun idle to say)
        net = [b for worker in read_workers(out / "pilot" / folder)
               for b in net_of_serving(worker, said["serving_cpu_ms"] / 1000)]
        assert said["by_size"] == at_measured_speed(COST, net)[1]["by_size"] and said["requests"] == 6


def test_with_skip_the_pilot_sends_the_trace_s_requests_before_the_planned_ones_at_their_rate() -> None:
    """Out of sample: with `--skip` leaving N requests, the pilot's are the trace's N just before the
    planned ones, their gaps in the trace's proportions, at the planned ones' requests per second (neither
    the planned clock's factor nor their prompt tokens per second: azure-mix's 10-30 are sparser and
    shorter than its 30-80); else the planned ones' first N at their own times."""
    from engine.planner.command import build_parser, load_workload, pilot_workload
    from loadtest.workload import azure_mix

    trace = azure_mix()
    args = build_parser().parse_args(["--skip", "30", "--requests", "50", "--rate", "16", "--pilot", "20"])
    w = load_workload(args)
    pilot, where = pilot_workload(args, w)
    assert where == "the trace's 20 requests before the planned ones, at their rate"
    earlier = trace.requests[10:30]
    assert [r.input_tokens for r in pilot.requests] == [r.input_tokens for r in earlier]
    assert pilot.rate == pytest.approx(16.0) and w.rate == pytest.approx(16.0)
    speed_up = (earlier[-1].arrival_s - earlier[0].arrival_s) / pilot.duration_s
    clock = (trace.requests[79].arrival_s - trace.requests[30].arrival_s) / w.duration_s
    assert abs(speed_up / clock - 1) > 0.1  # (azure-mix's 10-30 natively sparser than its 30-80)
    gaps = [b.arrival_s - a.arrival_s for a, b in pairwise(earlier)]
    assert [b.arrival_s - a.arrival_s for a, b in pairwise(pilot.requests)] == \
        pytest.approx([g / speed_up for g in gaps])
    args = build_parser().parse_args(["--skip", "10", "--requests", "50", "--rate", "16", "--pilot", "20"])
    w = load_workload(args)
    pilot, where = pilot_workload(args, w)
    assert where == "the workload's first 20 requests" and pilot.requests == w.requests[:20]


def test_each_policy_is_planned_at_its_own_pilot_s_speed_and_compared_so_with_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pilots whose batches ran 2x (fcfs) and 3x (chunked) the profile on one worker, a tenth slower on
    two: each policy's plan predicts at its own one-worker pilot's speed, with its worker's host time per
    batch and its requests' time outside the worker less that; plan.json says so under `pilot`, and
    `--against-serve 1,2` gets those as the planner's own prediction, its two-worker fleets the pilots of
    two workers. With `--pilot 0` an engine pass (here 2x) stands for every policy, with nothing outside."""
    from engine.bench.planner_validation import against_serve
    from engine.bench.planner_validation import command as bench_planner
    from engine.planner import speed

    def batches(factor: float) -> list[MeasuredBatch]:
        return [MeasuredBatch([f"w{i}"], 0.01 * (i + 1), factor * 0.01 * (i + 1), 1.0, 100 * (i + 1))
                for i in range(20)]

    factors = {"fcfs": 2.0, "chunked:512": 3.0}
    on_two = 1.1  # two workers on one machine run slower
    pilots: list[tuple[str, int, Path, int]] = []

    def fake_pilot(policy, threads, w, logs, workers):  # type: ignore[no-untyped-def]
        pilots.append((policy, len(w.requests), logs, workers))
        return batches(factors[policy] * (on_two if workers == 2 else 1.0)), {
            "sent": len(w.requests), "attainment": 1.0, "failed": 0, "logs": str(logs),
            "worker_host_ms": 1.0 + workers, "outside_worker_ms": 10.0}

    monkeypatch.setattr(speed, "serve_pilot", fake_pilot)
    monkeypatch.setattr(speed, "engine_pass", lambda *_a, **_k: batches(2.0))
    seen: dict[str, object] = {}

    def fake_compare(args, w, cost, engine_cfg, rounds, planned):  # type: ignore[no-untyped-def]
        seen.update(profile=cost, planned=planned)
        return []

    monkeypatch.setattr(against_serve, "real_rounds", lambda *_a, **_k: None)
    monkeypatch.setattr(against_serve, "compare_fleets", fake_compare)
    argv = ["--requests", "20", "--cost", "cpu", "--threads", "1", "--rate", "2", "--policies", "fcfs,chunked:512",
            "--max-instances", "2", "--against-serve", "1,2", "--pilot", "8", "--out", str(tmp_path)]
    assert bench_planner.main(argv) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert pilots == [("fcfs", 8, tmp_path / "pilot" / "fcfs-w1", 1), ("fcfs", 8, tmp_path / "pilot" / "fcfs-w2", 2),
                      ("chunked:512", 8, tmp_path / "pilot" / "chunked-512-w1", 1),
                      ("chunked:512", 8, tmp_path / "pilot" / "chunked-512-w2", 2)]
    assert {p: doc["pilot"][p]["factor"] for p in factors} == pytest.approx(factors) and "engine_pass" not in doc
    assert {p: doc["pilot"][p]["fleets"]["2"]["factor"] for p in factors} == pytest.approx(
        {p: f * on_two for p, f in factors.items()})

    def assert_planned_at(expected: dict[str, float], host_s: float, outside_s: float, workers: int = 1) -> None:
        """Each policy's cost model is its own pilot's speed on the profile, about that many times it (not
        exactly: a plan at 3x the cost is cut into more steps, each with its fixed cost, 6 % at 1,000 tokens
        on one profile)."""
        profile, speeds = seen["profile"], seen["planned"]
        planned = speeds.planned if workers == 1 else {p: speeds.fleets[(p, workers)] for p in expected}  # type: ignore[attr-defined]
        assert set(planned) == set(expected)
        for policy, factor in expected.items():
            own = speed.at_measured_speed(profile, batches(factor))[0]  # type: ignore[arg-type]
            assert planned[policy].cost.batch_host_s == pytest.approx(host_s)
            assert planned[policy].outside_s == pytest.approx(outside_s)
            for tokens in (100, 1000, 4000):
                span = [SeqSpan(0, tokens)]
                assert planned[policy].cost.prefill_s(span) == own.prefill_s(span)
                assert planned[policy].cost.prefill_s(span) == pytest.approx(
                    factor * profile.prefill_s(span), rel=0.15)  # type: ignore[attr-defined]

    assert_planned_at(factors, 0.002, 0.008)
    assert_planned_at({p: f * on_two for p, f in factors.items()}, 0.003, 0.007, workers=2)
    assert bench_planner.main([*argv, "--pilot", "0"]) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["engine_pass"]["factor"] == pytest.approx(2.0) and "pilot" not in doc and len(pilots) == 4
    assert_planned_at({"fcfs": 2.0, "chunked:512": 2.0}, 0.0, 0.0)
    assert not seen["planned"].fleets  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["no batch", "no start"])
def test_a_pilot_that_serves_nothing_stops_the_plan_with_its_reason(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A pilot whose serve did not start, or whose worker ran no batch, gives no speed to plan at: one
    line and exit 2, not a plan at the profile's speed that looks like a pilot's."""
    from engine.planner import command, serve_runs

    def real_point(policy, n, threads, w, schedule, logs):  # type: ignore[no-untyped-def]
        if how == "no start":
            raise RuntimeError("flowprefill serve: exited with code 2: address already in use")
        return {"attainment": 0.0, "failed": len(schedule)}, ["http://127.0.0.1:9001"], []

    monkeypatch.setattr(serve_runs, "real_point", real_point)
    with pytest.raises(SystemExit) as exited:
        command.main(["--requests", "20", "--cost", "cpu", "--threads", "1", "--rate", "2", "--policies", "fcfs",
                   "--pilot", "5", "--out", str(tmp_path)])
    assert exited.value.code == 2
    log = tmp_path / "pilot" / "fcfs-w1"
    why = {"no batch": f"fcfs's pilot ran no batch (5 of its 5 requests failed; its log: {log})",
           "no start": "fcfs's pilot: flowprefill serve: exited with code 2: address already in use"}[how]
    assert f"--pilot: {why} (--pilot 0 plans without one)" in capsys.readouterr().err


def _batch(ids: list[str], began: float, end: float, arrived: list[float]) -> MeasuredBatch:
    return MeasuredBatch(ids, 0.01, end - began, 1.0, 100, end, began, arrived)


def test_a_worker_s_own_time_between_batches_counts_only_where_work_was_waiting() -> None:
    """From one batch's end to the next one's first step: counted where the next one's requests had all
    arrived before (3 ms and 2 ms here), not where the worker waited for an arrival, nor across a batch
    left suspended (b's 50 ms after c ended ran the rest of b, not the host)."""
    from engine.planner.measured import host_gaps

    worker = [_batch(["a"], 0.0, 0.100, [0.0]),
              _batch(["b"], 0.103, 0.300, [0.05]),  # waited for: counted, 3 ms
              _batch(["c"], 0.150, 0.200, [0.149]),  # preempted b: began while b ran
              _batch(["d"], 0.302, 0.400, [0.2]),  # after b's end, 2 ms: counted
              _batch(["e"], 0.500, 0.600, [0.45]),  # arrived after d ended: the worker waited for it
              _batch(["f"], 0.700, 0.800, [0.55, 0.65])]  # one of two arrived after e ended: not counted
    assert host_gaps(worker) == pytest.approx([0.003, 0.002])
    assert host_gaps([MeasuredBatch(["x"], 0.01, 0.02, 1.0, 100, 1.0)]) == []  # an older log says nothing


def test_time_outside_the_worker_is_the_client_s_ttft_less_the_request_s_time_in_it() -> None:
    """A request's time in the worker: its arrival there to the end of its last batch (a chunked prompt's
    last chunk). What the client waited beyond that is the gateway's and the HTTP hops' (and sampling's);
    the plan charges it less the host time the simulator puts before each first token."""
    from engine.planner.measured import outside_worker, overheads, planned_with

    batches = [_batch(["w0", "w1"], 1.0, 1.1, [0.98, 0.99]), _batch(["w1"], 1.103, 1.2, [0.99])]
    ttfts = {"w0": 0.130, "w1": 0.221, "w9": 0.5}  # w9: never logged (a refused request)
    assert sorted(outside_worker(ttfts, batches)) == pytest.approx([0.010, 0.011])
    said = overheads([batches], ttfts)
    assert said == pytest.approx({"worker_host_ms": 3.0, "outside_worker_ms": 10.5})
    planned = planned_with(COST, said)  # type: ignore[arg-type]
    assert planned.cost.batch_host_s == pytest.approx(0.003) and planned.outside_s == pytest.approx(0.0075)
    assert overheads([[]], {}) == {"worker_host_ms": None, "outside_worker_ms": None}
    assert planned_with(COST, {"worker_host_ms": None, "outside_worker_ms": None}).outside_s == 0.0


def test_time_outside_the_instances_comes_out_of_every_request_s_ttft_budget() -> None:
    """Lone requests that the simulated instance answers with some time to spare meet their target with
    1 ms less than that spent outside the instances, and miss it with 1 ms more."""
    from engine.core.config import EngineConfig
    from engine.planner.fleet import Planner
    from engine.planner.measured import Planned
    from loadtest.workload import TraceRequest, Workload

    w = Workload("two", "test", "fixed", [TraceRequest(t, 1000, 1, "interactive") for t in (0.0, 10.0)])
    planner = Planner(w, COST, EngineConfig(prefix_caching=False), 0.9, False)
    alone = planner.evaluate("fcfs", 1)
    assert alone["attainment"] == 1.0
    spare = 0.250 - alone["per_class"]["interactive"]["ttft_p99_ms"] / 1000
    planner.use(Planned(COST, spare - 0.001))
    assert planner.evaluate("fcfs", 1, stop_early=False)["attainment"] == 1.0
    planner.use(Planned(COST, spare + 0.001))
    assert planner.evaluate("fcfs", 1, stop_early=False)["attainment"] == 0.0


def test_a_batch_s_spread_is_measured_around_its_own_size_s_median() -> None:
    """Small batches run 3x the profile and large ones 1.5x, each a factor e^0.1 either way: the spread
    is 0.1 (not the gap between the sizes); logs that do not say sizes give none."""
    import math

    from engine.planner.measured import spread

    batches = [MeasuredBatch([f"s{i}"], 0.01, 0.03 * math.exp(d), 1.0, 50) for i, d in enumerate((-0.1, 0, 0.1))]
    batches += [MeasuredBatch([f"l{i}"], 1.0, 1.5 * math.exp(d), 1.0, 4000) for i, d in enumerate((-0.1, 0, 0.1))]
    assert spread(batches) == pytest.approx(math.sqrt(2 / 3) * 0.1)
    assert spread([MeasuredBatch(["x"], 0.01, 0.03, 1.0)]) is None


def test_with_noise_a_fleet_is_judged_on_several_draws_pooled() -> None:
    """A planner with a spread of batch speeds runs the fleet NOISE_DRAWS times, each with its own draws,
    and reports their outcomes pooled: the per-class counts are the workload's, the attainment the mean of
    the draws'. Without noise, one run."""
    from engine.core.config import EngineConfig
    from engine.planner.fleet import NOISE_DRAWS, Planner
    from engine.planner.measured import Planned
    from loadtest.workload import TraceRequest, Workload

    w = Workload("burst", "test", "fixed", [TraceRequest(0.04 * i, 500, 1, "interactive") for i in range(10)])
    planner = Planner(w, COST, EngineConfig(prefix_caching=False), 0.9, False)
    planner.evaluate("fcfs", 1, stop_early=False)
    assert planner.sims == 1
    planner.use(Planned(COST, noise=0.5))
    pooled = planner.evaluate("fcfs", 1, stop_early=False)
    assert planner.sims == 1 + NOISE_DRAWS and pooled["per_class"]["interactive"]["n"] == 10
    draws = []
    for seed in range(NOISE_DRAWS):
        reqs, _fleet, _router = planner._run("fcfs", 1, seed, False, None)  # type: ignore[misc]
        draws.append(sum(r.ttft is not None and r.ttft <= r.ttft_target_s for r in reqs) / len(reqs))
    assert pooled["attainment"] == pytest.approx(sum(draws) / NOISE_DRAWS)
    assert len(set(draws)) > 1  # the draws differ


def test_a_batch_is_measured_net_of_the_serving_cpu_its_arrivals_took() -> None:
    """Two requests arrived at the worker while batch a ran whole, one while b ran for half of its span
    (suspended the other half): a loses 2 x 4 ms, b 0.5 x 4 ms; c, with no arrival during it, nothing;
    without a serving cost, or in an older log, the batches are as logged."""
    from engine.planner.measured import net_of_serving

    a = _batch(["x"], 0.0, 0.100, [0.0])
    b = MeasuredBatch(["y"], 0.01, 0.100, 1.0, 100, 0.400, 0.200, [0.05])
    c = _batch(["z"], 0.500, 0.600, [0.45])
    others = [_batch([f"o{i}"], 1.0, 1.1, [t]) for i, t in enumerate((0.02, 0.05, 0.3))]  # their arrivals
    net = net_of_serving([a, b, c, *others], 0.004)
    assert [n.exec_s for n in net[:3]] == pytest.approx([0.100 - 0.008, 0.100 - 0.002, 0.100])
    assert net_of_serving([a, b], 0.0) == [a, b]
    old = MeasuredBatch(["x"], 0.01, 0.02, 1.0, 100, 1.0)
    assert net_of_serving([old], 0.004) == [old]


def test_a_step_that_requests_arrive_in_ends_later_by_their_serving_cpu() -> None:
    """A long prefill with ten short requests arriving during it: with 10 ms of serving CPU per arrival
    its first token comes about 0.1 s later than without (every arrival stretches its running step; the
    short ones wait behind it in fcfs), in a lone simulation and as a fleet's one instance alike."""
    from dataclasses import replace

    from engine.core.config import EngineConfig
    from engine.core.scheduler import make_policy
    from engine.planner.fleet import Planner
    from engine.planner.measured import Planned
    from engine.protocol.slo import DEFAULT_CLASSES
    from engine.sim.simulator import SimConfig, simulate
    from loadtest.goodput import make_requests
    from loadtest.workload import TraceRequest, Workload

    w = Workload("long and short", "test", "fixed",
                 [TraceRequest(0.0, 4000, 1, "batch")] + [TraceRequest(0.01 * (i + 1), 50, 1, "interactive")
                                                          for i in range(10)])

    def long_ttft(arrival_cpu_s: float) -> float:
        reqs = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
        simulate(reqs, make_policy("fcfs"), COST, replace(SimConfig(), arrival_cpu_s=arrival_cpu_s))
        return reqs[0].ttft  # type: ignore[return-value]

    assert long_ttft(0.010) - long_ttft(0.0) == pytest.approx(0.100, abs=0.002)
    planner = Planner(w, COST, EngineConfig(prefix_caching=False), 0.9, False)

    def fleet_ttft(serving_s: float) -> float:
        planner.use(Planned(COST, serving_s=serving_s))
        return planner.evaluate("fcfs", 1, stop_early=False)["per_class"]["batch"]["ttft_p50_ms"] / 1000

    assert fleet_ttft(0.010) - fleet_ttft(0.0) == pytest.approx(0.100, abs=0.002)


def test_with_noise_a_fleet_stops_early_only_when_its_draws_pooled_cannot_reach_the_floor() -> None:
    """Pooled draws: a draw stops early once the misses of the draws so far and its own, with the draws
    to come all met, could not lift the pool to the floor (target less STOP_BELOW), not when that draw
    alone falls below it. An overload that one instance misses nearly whole (40 requests of 0.56 s each,
    20 a second): alone, its draw stops; as the first of NOISE_DRAWS it runs on (at most 40 missed of 40
    a draw, the floor allows 14 a draw); after all but 20 of the misses the floor allows, it stops.
    Evaluated, the pool stops early with at most what the misses leave, under the floor."""
    from engine.core.config import EngineConfig
    from engine.planner.fleet import NOISE_DRAWS, STOP_BELOW, Planner
    from engine.planner.measured import Planned
    from loadtest.workload import TraceRequest, Workload

    burst = Workload("overload", "test", "fixed", [TraceRequest(0.05 * i, 2000, 1, "interactive") for i in range(40)])
    planner = Planner(burst, COST, EngineConfig(prefix_caching=False), 0.9, False)
    planner.use(Planned(COST, noise=0.1))
    assert isinstance(planner._run("fcfs", 1, 0, True, None), dict)  # one draw alone: stopped
    assert isinstance(planner._run("fcfs", 1, 0, True, None, {}, NOISE_DRAWS), tuple)  # the first draw: runs on
    allowed = round((1 - (0.9 - STOP_BELOW)) * 40 * NOISE_DRAWS)
    assert isinstance(planner._run("fcfs", 1, 1, True, None, {"interactive": allowed - 20}, NOISE_DRAWS), dict)
    pooled = planner.evaluate("fcfs", 1)
    assert pooled["stopped_early"] and pooled["attainment_at_most"] < 0.9 - STOP_BELOW


def test_an_arrival_during_a_stretched_step_stretches_that_step_too() -> None:
    """A prefill ends at D0 alone. One short request arrives 1 ms before D0 and one 3 ms after: with 5 ms
    of serving CPU per arrival, the first stretches the prefill's last step to D0 + 5 ms, so the second
    arrives while it still runs and stretches it again: the first token at D0 + 10 ms, not D0 + 5 ms
    with the second's CPU left to the next batch."""
    from dataclasses import replace

    from engine.core.scheduler import make_policy
    from engine.protocol.slo import DEFAULT_CLASSES
    from engine.sim.simulator import SimConfig, simulate
    from loadtest.goodput import make_requests
    from loadtest.workload import TraceRequest, Workload

    def ttft_of_the_long(arrival_cpu_s: float, d0: float = 0.0) -> float:
        w = Workload("one and two", "test", "fixed", [TraceRequest(0.0, 500, 1, "batch"),
                                                        TraceRequest(d0 - 0.001, 50, 1, "interactive"),
                                                        TraceRequest(d0 + 0.003, 50, 1, "interactive")])
        reqs = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
        simulate(reqs, make_policy("fcfs"), COST, replace(SimConfig(), arrival_cpu_s=arrival_cpu_s))
        return reqs[0].ttft  # type: ignore[return-value]

    d0 = ttft_of_the_long(0.0, 1.0)  # the short ones long after: it runs alone
    assert ttft_of_the_long(0.005, d0) == pytest.approx(d0 + 0.010)


def test_noise_around_a_median_speed_has_median_one() -> None:
    """The planner's noise is drawn around the pilot's median speed per size: its draws' median is one
    (the mean e^(sigma^2/2)); `--errors noise`'s keep mean one."""
    import random
    import statistics

    from engine.sim.errors import PredictionError, TrueSpeed

    def draws(mean_one: bool) -> list[float]:
        speed = TrueSpeed(PredictionError(noise=0.3, noise_mean_one=mean_one), 0.0, random.Random(7))
        return [speed.batch_factor() for _ in range(20000)]

    assert statistics.median(draws(False)) == pytest.approx(1.0, abs=0.01)
    assert statistics.fmean(draws(True)) == pytest.approx(1.0, abs=0.01)
    assert statistics.fmean(draws(False)) == pytest.approx(2.718281828 ** (0.3 ** 2 / 2), abs=0.01)


def test_a_pilot_run_several_times_pools_its_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pilot-runs 3`: three fresh serves, each logging in its own run-<r>/ (an earlier pilot's runs
    removed first), their batches pooled and each overhead the median of the runs'; one run is the
    pilot itself, in its folder."""
    from engine.planner import speed

    calls: list[Path] = []

    def serve_pilot(policy, threads, pilot, logs, workers):  # type: ignore[no-untyped-def]
        calls.append(logs)
        r = len(calls)
        return [MeasuredBatch([f"p{r}"], 0.01, 0.01 * r, 1.0, 100)], {
            "sent": 5, "attainment": 0.5 + 0.1 * r, "failed": r - 1, "logs": str(logs),
            "worker_host_ms": float(r), "outside_worker_ms": None if r == 2 else 4.0 * r, "serving_cpu_ms": 2.0,
            "idle_wake_ms": None if r == 3 else float(r)}

    monkeypatch.setattr(speed, "serve_pilot", serve_pilot)
    stale = tmp_path / "fcfs-w2" / "run-9"
    stale.mkdir(parents=True)
    batches, said = speed.repeated_pilot("fcfs", 1, None, tmp_path / "fcfs-w2", 2, 3)  # type: ignore[arg-type]
    assert calls == [tmp_path / "fcfs-w2" / f"run-{r}" for r in (1, 2, 3)] and not stale.exists()
    assert [b.exec_s for b in batches] == pytest.approx([0.01, 0.02, 0.03])
    assert said.pop("runs_speed") == pytest.approx([0.5, 1.0, 1.5])  # each run's time per batch over the pooled 2x
    assert said == pytest.approx({"sent": 5, "attainment": 0.7, "failed": 3, "logs": str(tmp_path / "fcfs-w2"),
                                  "runs": 3, "worker_host_ms": 2.0, "outside_worker_ms": 8.0, "serving_cpu_ms": 2.0,
                                  "idle_wake_ms": 1.5})
    calls.clear()
    _, alone = speed.repeated_pilot("fcfs", 1, None, tmp_path / "fcfs-w1", 1, 1)  # type: ignore[arg-type]
    assert calls == [tmp_path / "fcfs-w1"] and "runs" not in alone


def test_interleaved_pilots_run_each_round_before_their_fleets_and_plan_at_every_round_pooled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--interleave-pilots --repeats 2 --against-serve 2`: in each round the one-worker pilot (what the
    plan's instances are; no real fleet of one here), then the two-worker pilot just before its real run.
    The plan and the real fleet's own prediction are at both rounds' pilots pooled (2x then 4x: 3x), a
    round whose pilot failed is left out (its cause said), and a pilot that failed in every round stops
    the plan with its cause, exit 2."""
    from engine.bench.planner_validation import command as bench_planner
    from engine.planner import serve_runs, speed
    from engine.planner.speed import PilotError

    calls: list[tuple[str, int, str]] = []
    broken: set[tuple[int, str]] = {(1, "run-1")}  # (workers, round): the one-worker pilot's first round fails

    def fake_pilot(policy, threads, w, logs, workers):  # type: ignore[no-untyped-def]
        calls.append(("pilot", workers, logs.name))
        if (workers, logs.name) in broken:
            raise PilotError(f"{policy}'s pilot: serve exited 2: address already in use")
        factor = 2.0 if logs.name == "run-1" else 4.0
        return [MeasuredBatch([f"w{i}"], 0.01, factor * 0.01, 1.0, 100) for i in range(len(w.requests))], {
            "sent": len(w.requests), "attainment": 1.0, "failed": 0, "logs": str(logs)}

    def fake_real_point(policy, n, threads, w, schedule, logs):  # type: ignore[no-untyped-def]
        calls.append(("real", n, logs.name))
        per_class = {"interactive": {"n": len(schedule), "attainment": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0}}
        pt = {"rate": w.rate, "attainment": 1.0, "goodput_rps": w.rate, "per_class": per_class, "preemptions": 0,
              "failed": 0, "command": "flowprefill serve"}
        return pt, [f"http://127.0.0.1:{9000 + i}" for i in range(n)], [MeasuredBatch(["w0"], 0.01, 0.02, 1.0, 100)]

    monkeypatch.setattr(speed, "serve_pilot", fake_pilot)
    monkeypatch.setattr(serve_runs, "real_point", fake_real_point)
    argv = ["--requests", "8", "--cost", "cpu", "--threads", "1", "--rate", "2", "--policies", "fcfs",
            "--max-instances", "2", "--against-serve", "2", "--repeats", "2", "--pilot", "4", "--interleave-pilots",
            "--out", str(tmp_path)]
    assert bench_planner.main(argv) == 0
    assert calls == [("pilot", 1, "run-1"), ("pilot", 2, "run-1"), ("real", 2, "run-1"),
                     ("pilot", 1, "run-2"), ("pilot", 2, "run-2"), ("real", 2, "run-2")]
    doc = json.loads((tmp_path / "plan.json").read_text())
    said = doc["pilot"]["fcfs"]
    assert said["runs"] == 1 and said["factor"] == pytest.approx(4.0)  # round 1's failed
    assert said["fleets"]["2"]["runs"] == 2 and said["fleets"]["2"]["factor"] == pytest.approx(3.0)
    assert said["fleets"]["2"]["logs"] == str(tmp_path / "pilot" / "fcfs-w2") and doc["pilots_interleaved"]
    assert said["fleets"]["2"]["runs_speed"] == pytest.approx([2 / 3, 4 / 3]) and said["runs_speed"] is None
    (row,) = doc["against_serve"]
    assert row["workers"] == 2 and "sim_planned" in row and len(row["real"]["runs"]) == 2
    assert row["planned_over_real_s"] == pytest.approx(1.5)  # planned at the pilots' 3x, the runs ran at 2x
    assert [r["round"] for r in row["sim_paired"]["rounds"]] == [1, 2]  # each run at its own round's pilot
    assert "sim_paired" in doc["against_serve_agreement"]
    assert doc["cost_profile"]["ffn_s_per_row"] > 0  # what it planned with, for a replay later
    assert (tmp_path / "against-serve.png").stat().st_size > 5_000  # each round's run against its pilot's prediction
    out = " ".join(capsys.readouterr().out.split())
    assert "round 1's pilot failed: fcfs's pilot: serve exited 2" in out
    assert "its 2 runs each took 0.67-1.33x the pooled time per batch" in out

    broken.add((1, "run-2"))
    with pytest.raises(SystemExit) as exited:
        bench_planner.main(argv)
    assert exited.value.code == 2
    assert "--pilot: fcfs's pilot: serve exited 2: address already in use (--pilot 0" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--pilot", "0"], ["--pilot-runs", "2"]])
def test_interleaved_pilots_need_a_pilot_and_one_pilot_run_per_round(
        extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from engine.bench.planner_validation import command as bench_planner

    with pytest.raises(SystemExit) as exited:
        bench_planner.main(["--requests", "8", "--against-serve", "1", "--interleave-pilots", *extra])
    assert exited.value.code == 2
    assert "--interleave-pilots runs a pilot in each round of --against-serve" in capsys.readouterr().err
