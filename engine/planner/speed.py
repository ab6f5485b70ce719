"""`flowprefill plan --cost cpu`: the operator profile checked against the engine itself, on the
workload's own prompts, before planning.

The profile times one block of each operator kind on an idle core (engine/model/calibration.py); the engine's
prefills run slower than that: on 2 AMD EPYC cores, one torch thread, azure-mix's first 200 prompts
through a fresh engine one at a time ran 1.25-1.33x the profile's seconds (2.1x for batches under 128
tokens, where a step's fixed costs dominate; 1.3x from 2K), and 1.14x on a second pass over the same
prompts (a fresh engine meets every shape for the first time, as a fresh `serve` worker does). Real
`serve --workers 1/2` fleets ran 1.23-1.39x. Planned from the profile alone, `plan` was 0-32 points
optimistic per class at one instance's knee. So the planner first runs the first
`--engine-pass` prompts of the workload through a fresh engine in this process, one at a time (no
queueing: only the engine's speed is measured, not the schedule), and simulates at the speed it
measured, a factor per batch size (`at_speed`, as `--speed-from` does with a pilot's logs).

One at a time in a bare engine is still not how a worker runs: real `serve --workers 1` (2 AMD EPYC
cores, one torch thread, azure-mix at 16 req/s) spent 7-15 % more time in its batches than the engine
pass's speed per size predicts for them, over twelve runs: the worker's HTTP server and its
streams share the engine's core, and requests arrive open loop into batches of every shape. So the
default is a **pilot** (`--pilot N`, `serve_pilot`): the workload's first N requests sent at their own
arrival times to a real `flowprefill serve --workers 1 --no-calibrate` of each policy (bench peer's
client, as `bench planner`'s real fleets are sent them; the worker predicts with the profile this planner reads), and
each policy planned at the speed its pilot's worker logged (engine/core/batch_log.py). 100 requests took
14-16 s per policy at 16 req/s. Against real fleets at one worker, the plan at the pilots' speed was a
mean 2.4-4.1 points off per class, at an engine pass's speed 4.9-5.5 (up to 17.5). Neither foresees the
machine's drift: where a shared machine slowed down within minutes, the plan at pilots taken a minute
before the fleets ran was 16.2 points off per class at one worker (hence `flowprefill bench planner
--interleave-pilots`, engine/bench/planner_validation/paired.py).

Speed per size is not all a pilot measures (engine/planner/measured.py): also the worker's own time
between batches, the time a request spends outside the worker, how far one batch's speed strays from
its size's, and the CPU the worker's HTTP side takes from the batches requests arrive in; the plan
simulates with all of them. And where real fleets of n > 1 workers share this machine (`flowprefill
bench planner --against-serve`), each gets a pilot of its own shape (`planning_costs`' `fleets`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shutil
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.progress import Progress

from engine.core.batch_log import MeasuredBatch, read
from engine.core.config import EngineConfig
from engine.model.cost import OpCost
from engine.planner import serve_runs
from engine.planner.measured import (
    OVERHEADS,
    Planned,
    median_overheads,
    planned_at,
    planned_with,
    relative_speeds,
    spread,
    strays,
    wander,
)
from engine.planner.serve_runs import fleet_name
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim.oracle import BatchCostRecorder, ExactCosts, at_speed, speed_by_size
from loadtest.goodput import make_requests
from loadtest.peer.client import arrivals
from loadtest.workload import Workload, head

ENGINE_PASS = 100  # prompts: about 4 s on 2 EPYC cores for azure-mix's, and every size class it has
PILOT = 100  # requests per policy: 14-16 s through `serve` at 16 req/s on 2 EPYC cores


PilotRun = tuple[list[MeasuredBatch], dict[str, Any]]  # a pilot run: its batches, and what it said


class PilotError(RuntimeError):
    """A pilot gave no speed to plan at: its serve did not start, or ran nothing."""


class Speeds(NamedTuple):
    """What each policy is planned with, where that came from (plan.json's key) and what it rests on;
    with real fleets beside the plan (`bench planner`), each one's own (policy, workers) where a pilot of
    its shape ran."""

    planned: dict[str, Planned]
    key: str | None = None
    said: dict[str, Any] | None = None
    fleets: dict[tuple[str, int], Planned] | None = None


def engine_pass(engine_cfg: EngineConfig, cost: OpCost, w: Workload, n: int, vocab: int,
                on_prompt: Callable[[int], None] = lambda _i: None) -> list[MeasuredBatch]:
    """The workload's first `n` prompts through a fresh engine, one at a time: each batch's seconds
    against what `cost` predicted for it."""
    from engine.core.engine import Engine, release_memory
    from engine.core.request import SamplingParams

    engine = Engine(engine_cfg, policy="fcfs", record_profile=False)
    engine.cost = engine.scheduler.cost = copy.deepcopy(cost)  # predicted as the planner will (it corrects its copy)
    recorder = BatchCostRecorder()
    engine.observers.append(recorder)
    try:
        engine.start()
        for i, req in enumerate(make_requests(head(w, n), DEFAULT_CLASSES, 1.0, 0.0, vocab)):
            with contextlib.suppress(ValueError):  # one the engine refuses (longer than its context): serve's 400
                engine.generate([req.prompt_token_ids], SamplingParams(max_tokens=1),
                                request_ids=[f"engine-pass-{i}"], timeout_s=600)
            on_prompt(i)
    finally:
        engine.shutdown()
        del engine
        release_memory()
    return recorder.batches


def at_measured_speed(cost: OpCost, batches: list[MeasuredBatch]) -> tuple[OpCost, dict[str, Any]]:
    """`cost` at the speed these batches ran: a factor per batch size where they say sizes, else the
    median factor of their requests; and what it rests on (for plan.json)."""
    exact = ExactCosts.from_batches(cost, batches)
    fitted = wander(batches)
    return at_speed(cost, batches, exact.default), {
        "factor": exact.default, "requests": len(exact.factors), "by_size": speed_by_size(batches),
        "spread": spread(batches), "wander": fitted._asdict() if fitted else None}


def serve_pilot(policy: str, threads: int | None, pilot: Workload, logs: Path, workers: int = 1) -> PilotRun:
    """`pilot`'s requests, at their own arrival times, through a real `flowprefill serve --workers <workers>
    --policy <policy>` (`--threads`, prefix caching off, `--no-calibrate`, its batch log in `logs`): the
    batches its workers ran, and the pilot's own goodput point with its workers' host time per batch and
    its requests' time outside them (what it rests on, for plan.json)."""
    shutil.rmtree(logs, ignore_errors=True)  # an earlier pilot's logs are not this one's
    try:  # prompts of their own: none is one a compared real run sends
        pt, _urls, batches = serve_runs.real_point(policy, workers, threads, pilot, arrivals(pilot, seed="pilot"), logs)
    except RuntimeError as exc:  # serve did not start
        raise PilotError(f"{policy}'s pilot: {exc}") from None
    n = len(pilot.requests)
    if not batches:
        raise PilotError(f"{policy}'s pilot ran no batch ({pt['failed']} of its {n} requests failed; its log: {logs})")
    return batches, {"sent": n, "attainment": pt["attainment"], "failed": pt["failed"], "logs": str(logs)} | {
        k: pt.get(k) for k in OVERHEADS}


def repeated_pilot(policy: str, threads: int | None, pilot: Workload, logs: Path, workers: int, runs: int
                   ) -> PilotRun:
    """`serve_pilot` `runs` times, each a fresh serve logging in `logs/run-<r>/`, pooled (`pooled`). One
    run is `serve_pilot` itself."""
    if runs == 1:
        return serve_pilot(policy, threads, pilot, logs, workers)
    shutil.rmtree(logs, ignore_errors=True)  # an earlier pilot's run-<r>/ folders are not this one's
    return pooled([serve_pilot(policy, threads, pilot, logs / f"run-{r + 1}", workers) for r in range(runs)], logs)


def pooled(done: list[PilotRun], logs: Path) -> PilotRun:
    """Several runs of one pilot as one: their batches pooled (a request's factor its seconds summed over
    the runs, as `bench planner` pools a fleet's runs), and per overhead the median of the runs'."""
    said = [run for _, run in done]
    return [b for bs, _ in done for b in bs], {
        "sent": said[0]["sent"], "attainment": statistics.median(run["attainment"] for run in said),
        "failed": sum(run["failed"] for run in said), "logs": str(logs), "runs": len(said),
        "runs_speed": relative_speeds([bs for bs, _ in done])} | median_overheads(said)


def measured_speed(cost: OpCost, folder: Path) -> tuple[OpCost, dict[str, Any]]:
    """`cost` at the speed a pilot's batch logs in `folder` measured (engine/core/batch_log.py): a factor
    per batch size where the logs say sizes, else the median factor by which its requests ran slower
    than `cost` predicts; and what it rests on."""
    return at_measured_speed(cost, read(folder))


def planning_costs(args: argparse.Namespace, w: Workload, pilot: Callable[[], tuple[Workload, str]], cost: OpCost,
                   vocab: int | None, engine_cfg: EngineConfig, policies: list[str], console: Console,
                   fleets: Sequence[int] = ()) -> Speeds:
    """What each policy's plan simulates: `cost` (the profile, or roofline) at the speed a pilot's logs
    measured (`--speed-from`), or for `--cost cpu` as each policy's own `serve` pilot ran (`--pilot`), or
    at an engine pass's speed (`--engine-pass`, with `--pilot 0`); where that came from (plan.json's key:
    "speed_from", "pilot", "engine_pass", or None for the cost model as it is). `pilot`: the pilot's
    requests and where in the trace they come from (command.py's `pilot_workload`), asked only where a pilot
    runs; `fleets`: the worker counts of real fleets to run beside the plan, each of n > 1 piloted too."""
    if args.speed_from is not None:
        at, measured = measured_speed(cost, Path(args.speed_from))
        return _same(policies, planned_at(at, measured), "speed_from",
                     {"from": args.speed_from} | measured, console,
                     f"a pilot's logs ({args.speed_from})")
    if args.cost != "cpu" or not vocab:
        return Speeds(dict.fromkeys(policies, Planned(cost)))
    if args.pilot:
        return _pilots(args, pilot, cost, policies, console, fleets)
    if args.engine_pass:
        n = min(args.engine_pass, len(w.requests))
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"engine pass: the workload's first {n} prompts, one at a time", total=n)
            batches = engine_pass(engine_cfg, cost, w, n, vocab, lambda _i: progress.advance(task))
        at, measured = at_measured_speed(cost, batches)
        return _same(policies, planned_at(at, measured), "engine_pass",
                     {"from": f"{n} prompts"} | measured, console,
                     f"an engine pass over the workload's first {n} prompts")
    return Speeds(dict.fromkeys(policies, Planned(cost)))


def _pilots(args: argparse.Namespace, pilot: Callable[[], tuple[Workload, str]], cost: OpCost, policies: list[str],
            console: Console, fleets: Sequence[int]) -> Speeds:
    """Each policy as its own pilot ran (`serve_pilot`): one worker for the plan, whose instances have
    their machines to themselves; and for each real fleet (`fleets`) of n > 1, a pilot of that fleet,
    whose workers share this machine's cores with each other and the gateway as its real runs' will (on
    2 EPYC cores two workers' batches ran 5.6-13.5 % slower per size than one worker's)."""
    w, where = pilot()
    ran = {}
    for policy, n in pilot_fleets(policies, fleets):
        console.print(f"pilot: serve --workers {n} --policy {policy}, {where}, over {w.duration_s:.0f} s")
        folder = Path(args.out) / "pilot" / fleet_name(policy, n)  # as --speed-from finds a fleet's own
        ran[(policy, n)] = repeated_pilot(policy, args.threads, w, folder, n, args.pilot_runs)
    return from_pilots(cost, ran, where, console)


def pilot_fleets(policies: list[str], fleets: Sequence[int] = ()) -> list[tuple[str, int]]:
    """The fleets a pilot runs for: each policy on one worker (what the plan's instances are), and on
    each real fleet's n > 1 workers (`fleets`: their worker counts)."""
    shared = [n for n in fleets if n > 1]
    return [(policy, n) for policy in policies for n in [1, *shared]]


def from_pilots(cost: OpCost, ran: dict[tuple[str, int], PilotRun], where: str, console: Console) -> Speeds:
    """What the pilots that ran (per fleet: its batches and what its runs said, in `pilot_fleets`'
    order) plan each policy and fleet with, said per policy as plan.json's `pilot`."""
    planned, fleets, said = {}, {}, {}
    for (policy, n), (batches, run) in ran.items():
        fleets[(policy, n)], measured = planned_from(cost, (batches, run))
        said.setdefault(policy, {}).setdefault("fleets", {})[str(n)] = (
            {"from": f"serve --workers {n}, {where}"} | measured | run)
        _say(console, f"{policy}'s pilot on {n} worker(s)", measured | run, fleets[(policy, n)])
    for policy in said:
        planned[policy] = fleets[(policy, 1)]
        said[policy] |= said[policy]["fleets"].pop("1")
        if not said[policy]["fleets"]:
            del said[policy]["fleets"]
    return Speeds(planned, "pilot", said, fleets)


def planned_from(cost: OpCost, pilot: PilotRun) -> tuple[Planned, dict[str, Any]]:
    """What a pilot (one run, or several pooled) plans a fleet with: `cost` at its speed per size, with its
    worker's host time per batch, its time outside the batches, its serving CPU and how its batches
    strayed; and what that speed rests on (`at_measured_speed`'s)."""
    batches, run = pilot
    at, measured = at_measured_speed(cost, batches)
    return planned_with(at, run, strays(measured)), measured


def _same(policies: list[str], planned: Planned, key: str, said: dict[str, Any], console: Console,
          source: str) -> Speeds:
    """Every policy at one speed (a pilot's logs, or the engine pass), said once."""
    _say(console, source, said, planned)
    return Speeds(dict.fromkeys(policies, planned), key, said)


def _say(console: Console, source: str, measured: dict[str, Any], planned: Planned) -> None:
    """The speed a plan runs at, by batch size, and the time outside the batches, as the command prints it."""
    sizes = measured["by_size"]
    by_size = "" if sizes is None else " by batch size " + "/".join(f"{f:.2f}" for f in sizes)
    extra = (f"; {planned.cost.batch_host_s * 1000:.1f} ms of the worker's own per batch"
             if planned.cost.batch_host_s else "")
    extra += f", {planned.outside_s * 1000:.1f} ms outside it per request" if planned.outside_s else ""
    extra += f", each batch's speed spread by a sigma of {planned.noise:.2f}" if planned.noise else ""
    extra += (f", the machine's wandering by {planned.drift:.2f} over {planned.drift_s:g} s" if planned.drift
              else "")
    extra += f", {planned.idle_wake_s * 1000:.1f} ms more for a batch begun idle" if planned.idle_wake_s else ""
    if runs := measured.get("runs_speed"):
        extra += (f"; its {len(runs)} runs each took {min(runs):.2f}-{max(runs):.2f}x the pooled time per batch "
                  "(how steady the machine was)")
    console.print(f"simulating at the speed {source} measured: {measured['factor']:.2f}x the cost model's seconds "
                  f"(median of {measured['requests']} requests){by_size}{extra}")
