"""`flowprefill plan --cost cpu`'s pilot (engine/bench/plan_speed.py): each policy planned at the speed a
short run of its real `serve --workers 1` measured, its workers predicting with the planner's profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sim import COST

from engine.batch_log import MeasuredBatch
from engine.model.plan import SeqSpan


def test_plan_on_this_cpu_pilots_each_policy_through_a_real_serve_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default for `--cost cpu`: the workload's first requests, at their arrival times, through a real
    `serve --workers 1` of each policy, each policy planned at the speed its own worker logged. Without
    --threads the workers get the planner's thread count, and with `--no-calibrate` they predict with its
    profile: the cache holds one profile and one start-up when the plan is done."""
    from engine.batch_log import read
    from engine.bench.plan_real import _sim_id
    from engine.bench.plan_speed import at_measured_speed
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
    for policy, folder in (("fcfs", "fcfs"), ("chunked:256", "chunked-256")):
        said = doc["pilot"][policy]
        assert said["from"] == "serve --workers 1, the workload's first 6 requests"
        assert said["sent"] == 6 and said["failed"] == 0 and said["logs"] == str(out / "pilot" / folder)
        batches = [b._replace(ids=[_sim_id(rid) for rid in b.ids]) for b in read(out / "pilot" / folder)]
        assert {rid for b in batches for rid in b.ids} == {f"w{i}" for i in range(6)}  # every pilot request
        assert said["by_size"] == at_measured_speed(COST, batches)[1]["by_size"] and said["requests"] == 6


def test_with_skip_the_pilot_sends_the_trace_s_requests_before_the_planned_ones() -> None:
    """Out of sample: with `--skip` leaving N requests, the pilot's are the trace's N just before the
    planned ones, sped up as --rate speeds up the planned ones; else the planned ones' first N."""
    from engine.bench.plan import build_parser, load_workload, pilot_workload
    from loadtest.workload import azure_mix

    trace = azure_mix()
    args = build_parser().parse_args(["--skip", "30", "--requests", "50", "--rate", "16", "--pilot", "20"])
    w = load_workload(args)
    pilot, where = pilot_workload(args, w)
    assert where == "the trace's 20 requests before the planned ones"
    assert [r.input_tokens for r in pilot.requests] == [r.input_tokens for r in trace.requests[10:30]]
    native = trace.requests[30:80]  # the planned ones, natively
    speed_up = (native[-1].arrival_s - native[0].arrival_s) / w.duration_s
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace.requests[10:30], trace.requests[11:30], strict=False)]
    assert [b.arrival_s - a.arrival_s for a, b in zip(pilot.requests, pilot.requests[1:], strict=False)] == \
        pytest.approx([g / speed_up for g in gaps])
    args = build_parser().parse_args(["--skip", "10", "--requests", "50", "--rate", "16", "--pilot", "20"])
    w = load_workload(args)
    pilot, where = pilot_workload(args, w)
    assert where == "the workload's first 20 requests" and pilot.requests == w.requests[:20]


def test_each_policy_is_planned_at_its_own_pilot_s_speed_and_compared_so_with_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pilots whose batches ran 2x (fcfs) and 3x (chunked) the profile: each policy's plan predicts at its
    own pilot's speed, plan.json says so under `pilot`, and `--against-serve` gets those cost models as the
    planner's own prediction. With `--pilot 0` an engine pass (here 2x) stands for every policy."""
    from engine.bench import plan, plan_real, plan_speed

    def batches(factor: float) -> list[MeasuredBatch]:
        return [MeasuredBatch([f"w{i}"], 0.01 * (i + 1), factor * 0.01 * (i + 1), 1.0, 100 * (i + 1))
                for i in range(20)]

    factors = {"fcfs": 2.0, "chunked:512": 3.0}
    pilots: list[tuple[str, int, Path]] = []

    def fake_pilot(policy, threads, w, logs):  # type: ignore[no-untyped-def]
        pilots.append((policy, len(w.requests), logs))
        return batches(factors[policy]), {"sent": len(w.requests), "attainment": 1.0, "failed": 0, "logs": str(logs)}

    monkeypatch.setattr(plan_speed, "serve_pilot", fake_pilot)
    monkeypatch.setattr(plan_speed, "engine_pass", lambda *_a, **_k: batches(2.0))
    seen: dict[str, object] = {}

    def fake_against_serve(args, w, cost, engine_cfg, policies, console, planned=None):  # type: ignore[no-untyped-def]
        seen.update(profile=cost, planned=planned)
        return []

    monkeypatch.setattr(plan_real, "against_serve", fake_against_serve)
    argv = ["--requests", "20", "--cost", "cpu", "--threads", "1", "--rate", "2", "--policies", "fcfs,chunked:512",
            "--max-instances", "2", "--against-serve", "1", "--pilot", "8", "--out", str(tmp_path)]
    assert plan.main(argv) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert pilots == [("fcfs", 8, tmp_path / "pilot" / "fcfs"), ("chunked:512", 8, tmp_path / "pilot" / "chunked-512")]
    assert {p: doc["pilot"][p]["factor"] for p in factors} == pytest.approx(factors) and "engine_pass" not in doc

    def assert_planned_at(expected: dict[str, float]) -> None:
        """Each policy's cost model is its own pilot's speed on the profile, about that many times it (not
        exactly: a plan at 3x the cost is cut into more steps, each with its fixed cost, 6 % at 1,000 tokens
        on one profile)."""
        profile, planned = seen["profile"], seen["planned"]
        assert set(planned) == set(expected)  # type: ignore[arg-type]
        for policy, factor in expected.items():
            own = plan_speed.at_measured_speed(profile, batches(factor))[0]  # type: ignore[arg-type]
            for tokens in (100, 1000, 4000):
                span = [SeqSpan(0, tokens)]
                assert planned[policy].prefill_s(span) == own.prefill_s(span)  # type: ignore[index]
                assert planned[policy].prefill_s(span) == pytest.approx(  # type: ignore[index]
                    factor * profile.prefill_s(span), rel=0.15)  # type: ignore[attr-defined]

    assert_planned_at(factors)
    assert plan.main([*argv, "--pilot", "0"]) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["engine_pass"]["factor"] == pytest.approx(2.0) and "pilot" not in doc and len(pilots) == 2
    assert_planned_at({"fcfs": 2.0, "chunked:512": 2.0})


@pytest.mark.parametrize("how", ["no batch", "no start"])
def test_a_pilot_that_serves_nothing_stops_the_plan_with_its_reason(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A pilot whose serve did not start, or whose worker ran no batch, gives no speed to plan at: one
    line and exit 2, not a plan at the profile's speed that looks like a pilot's."""
    from engine.bench import plan, plan_real

    def real_point(policy, n, threads, w, schedule, logs):  # type: ignore[no-untyped-def]
        if how == "no start":
            raise RuntimeError("flowprefill serve: exited with code 2: address already in use")
        return {"attainment": 0.0, "failed": len(schedule)}, ["http://127.0.0.1:9001"], []

    monkeypatch.setattr(plan_real, "real_point", real_point)
    with pytest.raises(SystemExit) as exited:
        plan.main(["--requests", "20", "--cost", "cpu", "--threads", "1", "--rate", "2", "--policies", "fcfs",
                   "--pilot", "5", "--out", str(tmp_path)])
    assert exited.value.code == 2
    log = tmp_path / "pilot" / "fcfs"
    why = {"no batch": f"fcfs's pilot ran no batch (5 of its 5 requests failed; its log: {log})",
           "no start": "fcfs's pilot: flowprefill serve: exited with code 2: address already in use"}[how]
    assert f"--pilot: {why} (--pilot 0 plans without one)" in capsys.readouterr().err
