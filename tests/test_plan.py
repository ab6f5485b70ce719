"""The capacity planner (`flowprefill plan`): its search finds the smallest fleet on a case whose answer
is known, one simulated instance is the single-instance simulator exactly, and the fleet is routed by
the gateway's own pool (its scoring and its prefix affinity)."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim import COST, requests, trace

from engine.core.config import EngineConfig
from engine.core.scheduler import make_policy
from engine.model.cost import SeqSpan
from engine.planner.fleet import Planner, smallest, with_prefixes
from engine.planner.routing import GatewayRouter, distinct_key, prompt_key, trace_key
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim import SimConfig, simulate
from engine.sim.fleet import Fleet
from gateway.routing import WorkerPool
from loadtest.goodput import make_requests
from loadtest.workload import PREFIX_BLOCK_TOKENS, TraceRequest, Workload, load_trace


def test_smallest_is_the_first_n_that_meets() -> None:
    asked: list[int] = []

    def meets(n: int) -> bool:
        asked.append(n)
        return n >= 37

    assert smallest(meets, 64) == 37
    assert len(asked) <= 13  # doubling to 64, then bisection of (32, 64]: not all 37 sizes
    assert smallest(lambda n: n >= 1, 64) == 1
    assert smallest(lambda n: False, 8) is None
    assert smallest(lambda n: n >= 8, 8) == 8


def bursts(k: int = 8, seconds: int = 10, tokens: int = 2048) -> Workload:
    """k equal `standard` prompts at once, every 2 s (when the gateway's once-a-second poll has just
    seen every instance drained)."""
    reqs = [TraceRequest(2.0 * s, tokens, 1, "standard") for s in range(seconds) for _ in range(k)]
    return Workload("bursts", "synthetic", "all standard", reqs)


def test_bisection_finds_the_minimum_on_a_known_case() -> None:
    """8 prompts at once, each 0.2 s alone (one per batch: 2048 tokens), 500 ms target, first come first
    served: an instance meets the target for its first two of a burst (0.2, 0.4 s) and misses the
    third (0.6 s). Spread evenly, N instances attain 2N of 8: 25, 50, 75 % for N = 1, 2, 3, all from
    4 on, so 90 % needs exactly 4."""
    cost = replace(COST, scale=0.2 / COST.prefill_s([SeqSpan(0, 2048)]))
    planner = Planner(bursts(), cost, EngineConfig(prefix_caching=False), target=0.9, every_class=False)
    seen: dict[int, float] = {}

    def meets(n: int) -> bool:
        pt = planner.evaluate("fcfs", n, stop_early=False)
        seen[n] = pt["attainment"]
        return planner.meets(pt)

    assert smallest(meets, 16) == 4
    assert seen == pytest.approx({1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0})


def test_a_run_far_below_the_target_stops_early() -> None:
    cost = replace(COST, scale=0.2 / COST.prefill_s([SeqSpan(0, 2048)]))
    planner = Planner(bursts(seconds=20), cost, EngineConfig(prefix_caching=False), target=0.9, every_class=False)
    pt = planner.evaluate("fcfs", 1)
    assert pt["stopped_early"] and pt["attainment_at_most"] < 0.65
    assert not planner.meets(pt)
    assert planner.evaluate("fcfs", 1, stop_early=False)["attainment"] == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize(("policy", "cfg"), [
    ("flowprefill", SimConfig(noise=0.2, seed=7)), ("flowprefill", SimConfig(ideal=True)),
    ("chunked:2048", SimConfig())])
def test_one_instance_is_the_single_instance_simulation(policy: str, cfg: SimConfig) -> None:
    """Bit for bit: the same first-token times, suspensions and preemptions."""
    alone, fleet_reqs = requests(trace(3.0, 100)), requests(trace(3.0, 100))
    pre = simulate(alone, make_policy(policy), COST, cfg)
    fleet = Fleet(fleet_reqs, 1, policy, COST, cfg, GatewayRouter(1, distinct_key()))
    assert fleet.run()
    assert (fleet.preemptions == pre and pre > 0) or policy.startswith(("chunked", "fcfs"))
    assert [r.times.first_token_time for r in fleet_reqs] == [r.times.first_token_time for r in alone]
    assert [len(r.times.suspensions) for r in fleet_reqs] == [len(r.times.suspensions) for r in alone]


def test_one_instance_is_the_single_instance_simulation_with_answers_too() -> None:
    """Decode steps are the instance's own events: answers pace the same behind a trivial router."""
    from engine.core.request import SamplingParams

    cost = replace(COST, decode_s=0.002, decode_s_per_seq=0.0005)
    alone, fleet_reqs = requests(trace(2.0, 60)), requests(trace(2.0, 60))
    for r in (*alone, *fleet_reqs):
        r.sampling = SamplingParams(max_tokens=20)
    simulate(alone, make_policy("flowprefill"), cost, SimConfig())
    fleet = Fleet(fleet_reqs, 1, "flowprefill", cost, SimConfig(), GatewayRouter(1, distinct_key()))
    assert fleet.run()
    assert all(len(r.output_token_ids) == 20 for r in fleet_reqs)
    assert [r.times.first_token_time for r in fleet_reqs] == [r.times.first_token_time for r in alone]
    assert [r.times.finish_time for r in fleet_reqs] == [r.times.finish_time for r in alone]


def _long_then_short(router: GatewayRouter) -> Fleet:
    """A 6000-token prompt at 0, a 100-token one at 1.5 s, after the poll at 1 s saw the first's backlog."""
    reqs = requests([(0.0, 6000, "batch"), (1.5, 100, "interactive")])
    fleet = Fleet(reqs, 2, "fcfs", COST, SimConfig(), router)
    assert fleet.run()
    return fleet


def test_the_fleet_routes_by_the_gateways_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    router = GatewayRouter(2, None)
    assert isinstance(router.pool, WorkerPool)
    fleet = _long_then_short(router)
    assert fleet.placed["r1"] != fleet.placed["r0"]  # least predicted backlog
    assert all(w.in_flight == 0 for w in router.pool.workers)  # every request released
    assert router.pool.workers[fleet.placed["r0"]].backlog_s > 0  # what the polls saw there
    # The ranking is the pool's own: score workers the other way round, and the fleet follows.
    monkeypatch.setattr(WorkerPool, "_score", lambda self, w: -(w.backlog_s + w.in_flight * self.per_request_s))
    fleet = _long_then_short(GatewayRouter(2, None))
    assert fleet.placed["r1"] == fleet.placed["r0"]


def test_where_the_polls_fall_decides_how_a_burst_is_shared() -> None:
    """A 6000-token prompt at 0, ten 100-token ones at once at 0.5 s: polled at 0.2 s, the pool saw the long
    one's backlog and sends them all to the other instance; first polled after them, it saw two idle
    instances and shares them by requests in flight. (The polls alone: without the load the instances
    report as they admit a request, which would tell the pool of the long one at once.)"""
    def burst(first_poll_s: float) -> Fleet:
        reqs = requests([(0.0, 6000, "batch")] + [(0.5 + 0.0001 * i, 100, "interactive") for i in range(10)])
        router = GatewayRouter(2, None, first_poll_s=first_poll_s)
        router.reported = lambda _i, _load: None  # type: ignore[method-assign]
        fleet = Fleet(reqs, 2, "fcfs", COST, SimConfig(), router)
        assert fleet.run()
        return fleet

    early, late = burst(0.2), burst(0.9)
    assert [early.placed[f"r{i}"] != early.placed["r0"] for i in range(1, 11)] == [True] * 10
    assert sum(late.placed[f"r{i}"] == late.placed["r0"] for i in range(1, 11)) >= 4


@pytest.mark.parametrize("reports", [True, False])
def test_an_instances_report_on_admission_ranks_it_until_the_next_poll(reports: bool) -> None:
    """A 6000-token prompt at 0.1 s, ten 100-token ones at once at 0.5 s, the loads polled at 0 s only (both
    idle). With each admission's report of the instance's predicted backlog, as a worker's answer carries
    it, the short ones all go to the other instance; ranked on the poll and requests in flight (50 ms
    each) alone, some queue behind the long one."""
    reqs = requests([(0.1, 6000, "batch")] + [(0.5 + 0.0001 * i, 100, "interactive") for i in range(10)])
    router = GatewayRouter(2, None, poll_s=100.0)
    reported: list[int] = []
    real = router.reported

    def reporting(instance: int, load: tuple[float, dict[str, float]]) -> None:
        reported.append(instance)
        if reports:
            real(instance, load)

    router.reported = reporting  # type: ignore[method-assign]
    fleet = Fleet(reqs, 2, "fcfs", COST, SimConfig(), router)
    assert fleet.run()
    assert reported == [fleet.placed[r.request_id] for r in reqs]  # one report per admission, where it ran
    behind_the_long = sum(fleet.placed[f"r{i}"] == fleet.placed["r0"] for i in range(1, 11))
    assert (behind_the_long == 0) if reports else (behind_the_long >= 3)


def test_the_planner_spreads_its_draws_over_where_the_gateways_polls_fall(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of a noisy plan's draws has the gateway's first poll at its own share of the poll interval;
    a plan of one draw polls at the interval's middle."""
    import engine.planner.fleet as fleet
    from engine.planner.fleet import NOISE_DRAWS
    from engine.planner.measured import Planned

    firsts: list[float] = []

    class Recording(GatewayRouter):
        def __init__(self, *args: object, first_poll_s: float = 0.0, **kwargs: object) -> None:
            firsts.append(first_poll_s)
            super().__init__(*args, first_poll_s=first_poll_s, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet, "GatewayRouter", Recording)
    planner = Planner(bursts(seconds=2), COST, EngineConfig(prefix_caching=False), 0.9, False, poll_s=0.5)
    planner.evaluate("fcfs", 2, stop_early=False)
    assert firsts == [0.25]
    planner.use(Planned(COST, noise=0.1))
    planner.evaluate("fcfs", 2, stop_early=False)
    assert firsts[1:] == pytest.approx([(k + 0.5) / NOISE_DRAWS * 0.5 for k in range(NOISE_DRAWS)])


def _conversation() -> list:  # type: ignore[type-arg]
    """A prompt, its next turn (the same prompt and more) 3 s later, an unrelated prompt just after."""
    reqs = requests([(0.0, 2000, "relaxed"), (3.0, 2500, "relaxed"), (3.1, 1500, "relaxed")], tokens=True)
    reqs[1].prompt_token_ids = reqs[0].prompt_token_ids + reqs[1].prompt_token_ids[:500]
    return reqs


def test_prefix_affinity_sends_a_shared_prefix_to_its_worker() -> None:
    """The gateway's prefix keys on the prompts' token ids: the next turn goes where the first went,
    found in the pool's prefix table (not by chance: for 2, 3 and 5 instances)."""
    for n in (2, 3, 5):
        router = GatewayRouter(n, prompt_key(1024))
        fleet = Fleet(_conversation(), n, "flowprefill", COST, SimConfig(), router)
        assert fleet.run()
        assert fleet.placed["r1"] == fleet.placed["r0"], n
        assert router.matched_chars >= 1024  # the second turn's match; the others found none


def test_a_traces_prefixes_are_routed_to_their_cache(tmp_path: Path) -> None:
    """Mooncake JSONL names each prompt's 512-token blocks: a prompt sharing blocks with an earlier one
    goes where that one ran (the gateway's prefix table) and computes only what is not cached there."""
    rows = [{"timestamp": 1000 * i, "input_length": 2048 + 100 * i, "output_length": 1,
             "hash_ids": [1, 2, 3, 10 + i] if i % 2 == 0 else [50 + i, 60 + i, 70 + i, 80 + i]} for i in range(8)]
    trace_file = tmp_path / "mooncake.jsonl"
    trace_file.write_text("\n".join(json.dumps(r) for r in rows))
    w = load_trace(trace_file)
    assert w.requests[2].prefix == (1, 2, 3, 12)
    for n in (2, 3, 4):
        reqs = with_prefixes(w, make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None))
        router = GatewayRouter(n, trace_key(1024, PREFIX_BLOCK_TOKENS))
        fleet = Fleet(reqs, n, "flowprefill", COST, SimConfig(), router, prefix_block_tokens=PREFIX_BLOCK_TOKENS)
        assert fleet.run()
        shared = [r for r in reqs if int(r.request_id[1:]) % 2 == 0]
        assert len({fleet.placed[r.request_id] for r in shared}) == 1, n
        assert [r.cached_tokens for r in shared] == [0, 3 * 512, 3 * 512, 3 * 512]
        assert all(r.cached_tokens == 0 for r in reqs if r not in shared)


def test_prompts_a_trace_names_no_blocks_of_share_nothing_in_a_caching_fleet() -> None:
    """Simulated prompts are placeholders (every prompt of a length alike): only a trace's hash ids share."""
    reqs = requests([(0.0, 2048, "batch"), (1.0, 2048, "batch"), (2.0, 2048, "batch")])
    reqs[0].block_hashes = [bytes([i]) for i in range(4)]
    fleet = Fleet(reqs, 1, "fcfs", COST, SimConfig(), GatewayRouter(1, distinct_key()),
                  prefix_block_tokens=PREFIX_BLOCK_TOKENS)
    assert fleet.run()
    assert [r.cached_tokens for r in reqs] == [0, 0, 0]


def test_the_command_writes_its_table_json_and_plot(tmp_path: Path) -> None:
    """`flowprefill plan` end to end on a GPU cost model: each policy's smallest fleet meets the target
    and the one below it (when tried) does not; the saving and the price follow from them."""
    from gateway.cli import main

    argv = ["plan", "--requests", "300", "--cost", "llama-3.1-8b@h100", "--rate", "120", "--policies",
            "flowprefill,fcfs", "--price", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    for name, pol in doc["policies"].items():
        n = pol["instances"]
        assert n is not None and pol["at_instances"]["attainment"] >= 0.9, name
        below = [p for p in pol["points"] if p["instances"] == n - 1]
        assert n == 1 or (below and (below[0]["stopped_early"] or below[0]["attainment"] < 0.9)), name
        hours = doc["workload"]["duration_s"] / 3600
        assert pol["cost_per_million_requests"] == pytest.approx(n * 2 * hours / 300 * 1e6)
    fleets = {name: pol["instances"] for name, pol in doc["policies"].items()}
    assert doc["instances_saved_by_flowprefill"] == {"fcfs": fleets["fcfs"] - fleets["flowprefill"]}


def test_a_worker_s_batch_log_is_what_the_planner_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$FLOWPREFILL_BATCH_LOG: each finished batch as the in-process recorder sees it, read back for
    `bench planner` (engine/core/batch_log.py); the replay client's ids as the simulation's."""
    from engine.core import batch_log
    from engine.core.engine import Engine
    from engine.core.request import SamplingParams
    from engine.planner.serve_runs import _sim_id
    from engine.sim.oracle import BatchCostRecorder

    monkeypatch.setenv(batch_log.ENV, str(tmp_path / "logs"))
    engine = Engine(EngineConfig(), policy="flowprefill")
    log = batch_log.attach(engine)
    recorder = BatchCostRecorder()
    engine.observers.append(recorder)
    engine.start()
    t0 = time.monotonic()
    try:
        engine.generate([[65] * 300, [66] * 40], SamplingParams(max_tokens=1))
    finally:
        engine.shutdown()
    t1 = time.monotonic()
    assert log is not None and log.path.parent == tmp_path / "logs"
    assert log._file.closed  # the engine's shutdown closed it
    logged = batch_log.read(tmp_path / "logs")
    assert len(logged) >= 1 and [list(b.ids) for b in logged] == [list(b.ids) for b in recorder.batches]
    assert [b[1:] for b in logged] == [b[1:] for b in recorder.batches]
    finished = [b.finished_at for b in logged]  # on the engine's clock (time.monotonic), in order
    assert all(f is not None and t0 <= f <= t1 for f in finished) and finished == sorted(finished)  # type: ignore[operator]
    for b in logged:  # its first step after its requests arrived, its end after that (the same clock)
        assert b.arrived_at is not None and len(b.arrived_at) == len(b.ids)
        assert b.began_at is not None and t0 <= max(b.arrived_at) <= b.began_at <= b.finished_at  # type: ignore[operator]
    assert _sim_id("peer-1764000000000-17") == "w17" and _sim_id("peer-1764000000000-17-0a1b2c3d") == "w17"
    monkeypatch.delenv(batch_log.ENV)
    assert batch_log.attach(engine) is None


def test_a_pilot_twice_as_slow_as_the_model_needs_a_bigger_fleet(tmp_path: Path) -> None:
    """`--speed-from`: the planner runs the cost model at the median speed a pilot's workers logged."""
    from gateway.cli import main

    logs = tmp_path / "pilot"
    logs.mkdir()
    lines = [json.dumps([[f"r{i}"], 0.010, 0.010 * f, 1.0]) for i, f in enumerate((1.9, 2.0, 2.0, 2.1, 9.0))]
    (logs / "batches-1.jsonl").write_text("\n".join(lines) + "\n")
    base = ["plan", "--requests", "300", "--cost", "llama-3.1-8b@h100", "--rate", "120", "--policies", "flowprefill"]
    assert main([*base, "--out", str(tmp_path / "model")]) == 0
    assert main([*base, "--speed-from", str(logs), "--out", str(tmp_path / "pilot-speed")]) == 0
    model, pilot = (json.loads((tmp_path / d / "plan.json").read_text()) for d in ("model", "pilot-speed"))
    assert pilot["speed_from"] == {"from": str(logs), "factor": pytest.approx(2.0), "requests": 5,  # the median
                                   "by_size": None, "spread": None,  # logs that do not say the batches' sizes
                                   "wander": None}
    assert pilot["policies"]["flowprefill"]["instances"] > model["policies"]["flowprefill"]["instances"]


def test_an_against_serve_run_s_logs_are_each_fleet_s_pilot(tmp_path: Path) -> None:
    """`bench planner` keeps each fleet's batch logs under `<out>/batch-logs/<policy>-w<n>/`; given
    as `--speed-from`, each point takes its own fleet's, and the planner the median of them all."""
    from engine.bench.planner_validation.against_serve import pilot_folder
    from gateway.cli import main

    root = tmp_path / "batch-logs"
    for fleet, factor in (("flowprefill-w1", 2.0), ("chunked-2048-w1", 3.0)):
        (root / fleet).mkdir(parents=True)
        lines = [json.dumps([[f"{fleet}-{i}"], 0.010, 0.010 * factor, 1.0]) for i in range(3 if factor == 2 else 2)]
        (root / fleet / "batches-7.jsonl").write_text("\n".join(lines) + "\n")
    assert pilot_folder(root, "flowprefill", 1) == root / "flowprefill-w1"
    assert pilot_folder(root, "chunked:2048", 1) == root / "chunked-2048-w1"
    assert pilot_folder(root, "flowprefill", 2) == root  # no run of that fleet: all of them
    argv = ["plan", "--requests", "50", "--skip", "10", "--cost", "llama-3.1-8b@h100", "--rate", "60",
            "--policies", "flowprefill", "--speed-from", str(root), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["speed_from"]["factor"] == pytest.approx(2.0) and doc["speed_from"]["requests"] == 5
    assert doc["workload"]["requests"] == 50


def test_a_cpu_simulation_reads_the_cached_profile_as_it_stands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """`--cost cpu`: the simulators' probe adds no calibration to the profile cache, so that two runs
    plan with the same profile; an engine's start-up adds its own."""
    from engine.core.engine import Engine
    from loadtest.goodput import Runner

    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path))
    Engine(EngineConfig(prefix_caching=False))
    (path,) = tmp_path.glob("opcost-*.json")
    cached = path.read_text()
    first, second = (Runner("sim", EngineConfig(prefix_caching=False), "cpu").cost for _ in range(2))
    assert first == second and path.read_text() == cached
    Engine(EngineConfig(prefix_caching=False))
    assert len(json.loads(path.read_text())["calibrations"]) == 2


def test_a_pilot_s_speed_is_learned_per_batch_size(tmp_path: Path) -> None:
    """Batch logs that say the batches' sizes give a factor per size class (short batches ran 3x the
    profile, long ones 1.5x: one median would charge the long ones 3x); a class no batch measured
    takes its nearest one's; logs without sizes (written before they were) one factor for all."""
    from engine.core.batch_log import MeasuredBatch
    from engine.sim.oracle import at_speed, speed_by_size

    short = [MeasuredBatch([f"s{i}"], 0.01, 0.03, 1.0, 100) for i in range(5)]
    long = [MeasuredBatch(["l0"], 1.0, 1.5, 1.0, 4000), MeasuredBatch(["l1"], 1.0, 1.5, 1.0, 5000)]
    factors = speed_by_size(short + long)
    assert factors == pytest.approx([3.0, 3.0, 1.5, 1.5, 1.5])  # <=128, 512 (nearest: 128's), 2K (8K's), 8K, more
    cost = at_speed(COST, short + long, default=9.0)
    for tokens, factor in ((100, 3.0), (4000, 1.5)):
        assert cost.prefill_s([SeqSpan(0, tokens)]) == pytest.approx(COST.prefill_s([SeqSpan(0, tokens)]) * factor)
    untold = [b._replace(tokens=None) for b in short + long]
    assert speed_by_size(untold) is None and at_speed(COST, untold, default=2.0).scale == 2.0
    from gateway.cli import main

    logs = tmp_path / "pilot"
    logs.mkdir()
    (logs / "batches-1.jsonl").write_text("".join(json.dumps(list(b)) + "\n" for b in short + long))
    argv = ["plan", "--requests", "100", "--cost", "llama-3.1-8b@h100", "--rate", "60", "--policies", "flowprefill",
            "--speed-from", str(logs), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["speed_from"]["by_size"] == pytest.approx([3.0, 3.0, 1.5, 1.5, 1.5])


def test_against_serve_starts_serve_on_another_port_when_its_port_was_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port free when chosen can be taken before `serve` binds it: serve refuses (exit 2, "address
    already in use" in its log) and another port is tried; any other refusal is an error naming serve's
    own words."""
    import socket

    from engine.planner import serve_runs
    from gateway.processes import free_port, healthy, stop

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen: list[int] = []

    # later ports are chosen when asked, as serve's retry chooses them: one chosen up front could be taken by a
    # parallel test's server while the first attempt fails (seen in CI)
    def taken_first(span: int = 1) -> int:
        chosen.append(taken.getsockname()[1] if not chosen else free_port(span=span))
        return chosen[-1]

    monkeypatch.setattr(serve_runs, "free_port", taken_first)
    try:
        proc, port, argv = serve_runs._start_serve("fcfs", 1, 1, tmp_path)
        try:
            assert chosen[0] == taken.getsockname()[1] and port == chosen[-1] != chosen[0]
            assert healthy(f"http://127.0.0.1:{port}")
            assert "--no-calibrate" in argv  # its workers predict with the planner's profile
            assert "in use" in (tmp_path / "serve-0.log").read_text()
        finally:
            stop(proc)
    finally:
        taken.close()

    monkeypatch.setattr(serve_runs, "free_port", free_port)
    with pytest.raises(RuntimeError, match=r"exited with code 2: .*nonsense"):
        serve_runs._start_serve("nonsense", 1, 1, tmp_path, tries=1)


def test_the_engine_pass_times_each_prompt_on_a_fresh_engine_and_returns_its_threads() -> None:
    """`plan --cost cpu` first runs the workload's first prompts through the engine one at a time: a batch
    per prompt, in order, each predicted by the planner's cost model; the engine is shut down after."""
    import statistics
    import threading

    from engine.model.cost import size_class
    from engine.planner.speed import at_measured_speed, engine_pass
    from loadtest.goodput import Runner
    from loadtest.workload import azure_mix, head

    cfg = EngineConfig(prefix_caching=False, num_threads=1)
    runner = Runner("sim", cfg, "cpu")
    w = head(azure_mix(), 6)
    threads = threading.active_count()
    done: list[int] = []
    batches = engine_pass(cfg, runner.cost, w, 6, runner.vocab or 0, done.append)
    assert done == list(range(6)) and threading.active_count() == threads
    assert [list(b.ids) for b in batches] == [[f"engine-pass-{i}"] for i in range(6)]
    assert [b.tokens for b in batches] == [r.input_tokens for r in w.requests]
    assert all(b.exec_s > 0 and b.base_s > 0 for b in batches)
    cost, measured = at_measured_speed(runner.cost, batches)
    assert measured["requests"] == 6
    b = batches[0]  # its size class's factor is the median of that class's batches (this one among them)
    same = [x.exec_s / x.base_s for x in batches if size_class(x.tokens or 0) == size_class(b.tokens or 0)]
    assert cost.factor(b.tokens or 0) == pytest.approx(statistics.median(same))


def test_plan_on_this_cpu_plans_at_the_engine_pass_speed_unless_told_not_to(tmp_path: Path) -> None:
    from gateway.cli import main

    base = ["plan", "--requests", "20", "--cost", "cpu", "--threads", "1", "--rate", "2", "--policies", "fcfs",
            "--max-instances", "2", "--pilot", "0"]
    assert main([*base, "--engine-pass", "8", "--out", str(tmp_path / "pass")]) == 0
    assert main([*base, "--engine-pass", "0", "--out", str(tmp_path / "profile")]) == 0
    with_pass, alone = (json.loads((tmp_path / d / "plan.json").read_text()) for d in ("pass", "profile"))
    assert with_pass["engine_pass"]["from"] == "8 prompts" and with_pass["engine_pass"]["requests"] == 8
    assert len(with_pass["engine_pass"]["by_size"]) == 5 and "engine_pass" not in alone
    assert "pilot" not in with_pass and "pilot" not in alone


def test_repeated_real_runs_are_compared_by_their_median_per_class() -> None:
    """`--against-serve --repeats 3`: per class and overall the median of the runs, each run kept."""
    from engine.bench.planner_validation.median import median_run
    from engine.bench.planner_validation.report import _real_cell

    def run(interactive: float, standard: float, failed: int = 0) -> dict[str, object]:
        per_class = {"interactive": {"n": 10, "attainment": interactive, "ttft_p50_ms": 50.0, "ttft_p99_ms": 900.0},
                     "standard": {"n": 10, "attainment": standard, "ttft_p50_ms": None, "ttft_p99_ms": None}}
        return {"rate": 4.0, "attainment": (interactive + standard) / 2, "goodput_rps": 0.0, "per_class": per_class,
                "preemptions": 2, "failed": failed, "command": "flowprefill serve"}

    one = run(0.9, 0.5)
    assert median_run([one]) is one
    med = median_run([run(0.9, 0.5), run(0.7, 0.9, failed=1), run(1.0, 0.6)])
    assert med["per_class"]["interactive"]["attainment"] == 0.9 and med["per_class"]["standard"]["attainment"] == 0.6
    assert med["attainment"] == pytest.approx(0.8) and med["goodput_rps"] == pytest.approx(3.2)  # runs: .7, .8, .8
    assert med["per_class"]["standard"]["ttft_p50_ms"] is None and med["failed"] == 1
    assert [r["per_class"]["standard"] for r in med["runs"]] == [0.5, 0.9, 0.6]
    assert med["per_class"]["standard"]["median_interval"] == [0.5, 0.9]  # three runs: any of them can be it
    assert _real_cell(med, "standard") == "60.0 % [50.0-90.0]" and _real_cell(one, "all") == "70.0 %"


def test_the_real_median_interval_narrows_with_runs_that_agree() -> None:
    """How well a fleet's runs know their median: the central 90 % of bootstrap medians, within the
    runs' range, narrower the more runs agree; the same twice (seeded)."""
    from engine.bench.planner_validation.median import median_interval

    scattered = [0.64, 0.48, 0.78, 0.78, 0.57, 0.70, 0.58, 0.46, 0.79]  # chunked:2048, one worker, 2026-12-06
    lo, hi = median_interval(scattered)
    assert 0.46 < lo < 0.64 < hi < 0.79 and hi - lo > 0.10  # the median is known to no better than 10 points
    assert median_interval(scattered) == [lo, hi]
    agreeing = [0.99, 0.99, 1.0, 1.0, 0.98, 1.0, 0.98, 1.0, 1.0]
    lo2, hi2 = median_interval(agreeing)
    assert hi2 - lo2 <= 0.01 + 1e-9 and lo2 <= 1.0 <= hi2


def test_agreement_counts_cells_within_the_band_leaving_out_small_classes() -> None:
    """The verdict `--against-serve` prints: per simulation, the cells (class of at least 20 requests, and
    overall) within 5 points of the real median, and its largest gap; a fleet that never ran has none."""
    from rich.console import Console

    from engine.bench.planner_validation.report import agreement, print_agreement

    def pt(overall: float, interactive: float, relaxed: float) -> dict[str, object]:
        return {"attainment": overall, "per_class": {"interactive": {"n": 122, "attainment": interactive},
                                                     "relaxed": {"n": 14, "attainment": relaxed}}}

    rows = [{"policy": "flowprefill", "workers": 1, "real": pt(0.70, 0.80, 0.50),
             "sim_planned": pt(0.74, 0.85, 0.90), "sim_measured_speed": pt(0.70, 0.80, 0.50)},
            {"policy": "flowprefill", "workers": 2, "real": pt(0.90, 0.95, 1.0),
             "sim_planned": pt(0.84, 0.96, 1.0), "sim_measured_speed": pt(0.91, 0.9, 1.0)},
            {"policy": "fcfs", "workers": 1, "failed_runs": ["serve exited 2"]}]
    summary = agreement(rows)
    assert summary["left_out"] == ["relaxed"] and summary["band_points"] == 5
    planned = summary["sim_planned"]  # gaps +4, +5 (on the band: in), -6, +1; relaxed's +40 not counted
    assert (planned["cells"], planned["within"]) == (4, 3)
    assert planned["largest_gap"] == {"policy": "flowprefill", "workers": 2, "class": "all",
                                      "points": pytest.approx(-6.0)}
    assert summary["sim_measured_speed"]["within"] == 4 and "sim" not in summary
    assert planned["beyond_interval"] == 1  # one run each: its interval is itself, so the -6 is beyond
    rows[1]["real"]["median_interval"] = [0.84, 0.95]  # runs that scattered: 0.84 is inside, the miss is not told
    assert agreement(rows)["sim_planned"]["beyond_interval"] == 0
    rows[1]["real"]["median_interval"] = [0.895, 0.95]  # 5.5 points from its nearer end: told
    assert agreement(rows)["sim_planned"]["beyond_interval"] == 1
    console = Console(record=True, width=200)
    print_agreement(console, summary)
    text = console.export_text()
    assert ("as planned: 3 of 4 cells; largest gap -6.0 (flowprefill on 2 workers, all); 1 beyond 5 points of "
            "the real median's 90 % interval") in text
    assert "not counted: relaxed" in text


def test_against_serve_repeats_in_rounds_keeps_each_run_and_survives_a_failed_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--repeats 2`: every fleet once per round, each run's logs in `run-<r>/` (an earlier run's logs
    removed first), the median compared; a run whose serve did not start is reported, not fatal."""
    from rich.console import Console

    from engine.bench.planner_validation.against_serve import compare_fleets, real_rounds
    from engine.bench.planner_validation.command import build_parser
    from engine.bench.planner_validation.report import against_table
    from engine.core.batch_log import MeasuredBatch
    from engine.planner import serve_runs
    from loadtest.workload import azure_mix, head

    stale = tmp_path / "batch-logs" / "fcfs-w1" / "batches-1.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps([["w0"], 1.0, 100.0, 1.0, 10]) + "\n")  # would make w0 100x slow if read
    calls: list[tuple[str, int, str]] = []

    def fake_real_point(policy, n, threads, w, schedule, logs):  # type: ignore[no-untyped-def]
        calls.append((policy, n, logs.name))
        assert not stale.exists()
        if (policy, logs.name) == ("flowprefill", "run-2") or policy == "chunked:2048":
            raise RuntimeError("serve exited 2: address already in use")
        per_class = {"interactive": {"n": len(schedule), "attainment": 0.5 + 0.25 * (logs.name == "run-2"),
                                     "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0}}
        pt = {"rate": w.rate, "attainment": per_class["interactive"]["attainment"], "goodput_rps": 0.0,
              "per_class": per_class, "preemptions": 0, "failed": 0, "command": "flowprefill serve"}
        return pt, [f"http://127.0.0.1:{9000 + i}" for i in range(n)], [MeasuredBatch(["w0"], 0.01, 0.02, 1.0, 10)]

    monkeypatch.setattr(serve_runs, "real_point", fake_real_point)
    policies = ["fcfs", "flowprefill", "chunked:2048"]
    args = build_parser().parse_args(["--requests", "6", "--rate", "2", "--against-serve", "1", "--repeats", "2",
                                      "--policies", ",".join(policies), "--out", str(tmp_path)])
    w = head(azure_mix(), 6)
    rounds = real_rounds(args, w, policies, Console(file=None, quiet=True))
    rows = compare_fleets(args, w, COST, EngineConfig(prefix_caching=False), rounds, None)
    assert calls == [(p, 1, f"run-{r}") for r in (1, 2) for p in policies]
    fcfs, flow, chunked = rows
    assert fcfs["real"]["attainment"] == pytest.approx(0.625) and len(fcfs["real"]["runs"]) == 2
    assert [r["measured_factor_median"] for r in fcfs["real"]["runs"]] == pytest.approx([2.0, 2.0])
    assert fcfs["measured_factor_median"] == pytest.approx(2.0)  # the stale 100x log was not read
    assert flow["failed_runs"] == ["serve exited 2: address already in use"] and "runs" not in flow["real"]
    refused = "serve exited 2: address already in use"
    assert chunked == {"policy": "chunked:2048", "workers": 1, "failed_runs": [refused] * 2}
    console = Console(record=True, width=300)
    against_table(console, rows)
    table = console.export_text()
    assert "2 run(s) failed" in table and "62.5 % [50.0-75.0]" in table


def test_against_serve_simulates_the_real_fleet_routed_by_load_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `serve --no-prefix-caching` it starts routes without prefix affinity (gateway/cli/serve.py), so
    its simulated twin does too, whatever `--prefix-affinity-chars` the plan itself uses: with affinity,
    which ports two workers got moved a simulated fleet's attainment by 16 points."""
    from rich.console import Console

    from engine.bench.planner_validation import against_serve
    from engine.bench.planner_validation.command import build_parser
    from engine.core.batch_log import MeasuredBatch
    from engine.planner import serve_runs
    from engine.planner.fleet import Planner
    from loadtest.workload import azure_mix, head

    def fake_real_point(policy, n, threads, w, schedule, logs):  # type: ignore[no-untyped-def]
        per_class = {"interactive": {"n": len(schedule), "attainment": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0}}
        pt = {"rate": w.rate, "attainment": 1.0, "goodput_rps": 0.0, "per_class": per_class, "preemptions": 0,
              "failed": 0, "command": "flowprefill serve"}
        return pt, [f"http://127.0.0.1:{9000 + i}" for i in range(n)], [MeasuredBatch(["w0"], 0.01, 0.02, 1.0, 10)]

    keys: list[object] = []

    class Spy(Planner):
        def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
            keys.append(kw.get("key_of"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(serve_runs, "real_point", fake_real_point)
    monkeypatch.setattr(against_serve, "Planner", Spy)
    args = build_parser().parse_args(["--requests", "6", "--rate", "2", "--against-serve", "2", "--policies", "fcfs",
                                      "--prefix-affinity-chars", "1024", "--out", str(tmp_path)])
    w = head(azure_mix(), 6)
    rows = against_serve.compare_fleets(args, w, COST, EngineConfig(prefix_caching=False),
                                    against_serve.real_rounds(args, w, ["fcfs"], Console(file=None, quiet=True)), None)
    assert rows[0]["real"]["attainment"] == 1.0 and keys == [None]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two cores and CPU affinity")
def test_the_load_generator_leaves_a_lone_worker_its_core_and_gets_its_own_back() -> None:
    from engine.planner.serve_runs import off_the_workers_cores
    from gateway.cli.serve import Cores, worker_threads

    before = os.sched_getaffinity(0)
    ns = argparse.Namespace(device="cpu", cpu_cores=None, workers=1, num_threads=1)
    cores = Cores.plan(ns, worker_threads(ns))
    assert cores is not None
    with pytest.raises(RuntimeError), off_the_workers_cores(1, 1):
        assert os.sched_getaffinity(0) == cores.shared and not cores.shared & cores.own[0]
        raise RuntimeError("the replay failed")
    assert os.sched_getaffinity(0) == before


def test_headroom_plans_for_a_slower_machine(tmp_path: Path) -> None:
    """`--headroom 1`: planned as if every prefill took twice as long, exactly as at a pilot's 2x speed."""
    from gateway.cli import main

    logs = tmp_path / "pilot"
    logs.mkdir()
    (logs / "batches-1.jsonl").write_text("".join(json.dumps([[f"r{i}"], 0.01, 0.02, 1.0]) + "\n" for i in range(3)))
    base = ["plan", "--requests", "300", "--cost", "llama-3.1-8b@h100", "--rate", "120", "--policies", "flowprefill"]
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    assert main([*base, "--headroom", "1", "--out", str(tmp_path / "headroom")]) == 0
    assert main([*base, "--speed-from", str(logs), "--out", str(tmp_path / "pilot-2x")]) == 0
    plain, headroom, pilot = (json.loads((tmp_path / d / "plan.json").read_text())["policies"]["flowprefill"]
                              for d in ("plain", "headroom", "pilot-2x"))
    assert headroom["instances"] == pilot["instances"] > plain["instances"]
    assert headroom["at_instances"]["attainment"] == pilot["at_instances"]["attainment"]
