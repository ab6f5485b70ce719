"""`flowprefill plan --against-serve N,N`: the planner's fleet against the real one on this machine.

For each policy and each N: `flowprefill serve --workers N` (the gateway and N engine workers, each
`--threads` torch threads, prefix caching off as in the simulation) is started, the workload's arrivals
are sent to it open loop (bench peer's client: streamed completions of one token, TTFT at the client),
and the planner simulates the same arrivals on N instances with the same prompts, routed by load alone
as that gateway routes them (serve turns prefix affinity off where its workers cache no prefixes), and
the cost model profiled here. Per class, the two attainments side by side, and a third: the same fleet
simulated with each request charged what the real workers measured for it (their batch logs,
engine/core/batch_log.py, replayed as engine/sim/oracle.py's ExactCosts), and a fourth: the cost model run at
the speed those logs measured, a factor per batch size (what `--speed-from` does). Where the third
agrees with the real run and the second does not, the cost model is what is off, not the fleet's
mechanics (routing, polling, admission, queueing); the fourth says how much of that knowledge of the
machine's speed fixes. Those two learn from the run they are compared with; the fifth, with
`--speed-from` a pilot's logs, does not: the cost model at the speed an earlier run of the same fleet
measured on other arrivals (each point's logs are kept in `<out>/batch-logs/<policy>-w<n>/` to be such a
pilot), which is what a planner knows before the fleet exists. With `--cost cpu`, the plan itself runs
at the speed of each policy's own short `serve` pilot on the workload's first requests
(engine/bench/plan_speed.py): that fleet, "as planned", is the planner's own prediction. `--repeats R`
runs each real fleet R times, in rounds, and compares with the median of its runs per class (each run's
logs in `run-<r>/`); with `--interleave-pilots` each round also runs each fleet's pilot just before its real
run (`real_rounds`), and the plan is made after the rounds, at their pilots pooled.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import shutil
import statistics
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console

from engine.bench.plan import workers_of
from engine.bench.plan_fleet import Planner
from engine.bench.plan_measured import (
    Planned,
    idle_wake,
    median_overheads,
    net_of_serving,
    net_of_wake,
    overheads,
    planned_at,
    planned_with,
    wander,
)
from engine.bench.plan_paired import Pair, paired
from engine.bench.plan_speed import PilotError, PilotRun, Speeds, measured_speed
from engine.core.batch_log import ENV as BATCH_LOG
from engine.core.batch_log import MeasuredBatch, read_workers
from engine.core.config import EngineConfig
from engine.core.request import Request
from engine.model.plan import OpCost
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim.oracle import ExactCosts, at_speed, speed_by_size
from gateway.processes import free_port, last_line, start, stop, wait_healthy
from loadtest import report
from loadtest.goodput import make_requests
from loadtest.peer.client import Arrival, Target, arrival_index, arrivals, model_name, replay
from loadtest.results import outcomes
from loadtest.server import ServerCounters
from loadtest.workload import Workload

Run = tuple[dict[str, Any], list[str], list[MeasuredBatch]]  # a real run: its point, its workers' URLs, its batches


def fleet_name(policy: str, n: int) -> str:
    """A point's folder name under `<out>/batch-logs/`, e.g. `chunked-2048-w2`."""
    return f"{policy.replace(':', '-')}-w{n}"


def real_point(policy: str, n: int, threads: int | None, w: Workload, schedule: list[Arrival], logs: Path) -> Run:
    """`serve --workers n` on the schedule, its workers logging their batches in `logs`: its goodput
    point (with the workers' host time per batch, the requests' time outside them, and the serving
    side's CPU per request), its workers' URLs, and the batches they ran, each less what the serving
    side took from it (`net_of_serving`) and, begun on an idle worker, less what that cost it (`idle_wake`,
    `net_of_wake`; request ids as the simulation's: `w{i}` for the schedule's i-th arrival)."""
    logs.mkdir(parents=True, exist_ok=True)  # real_rounds emptied it: an earlier run's logs are not read
    proc, port, argv = _start_serve(policy, n, threads, logs)
    url = f"http://127.0.0.1:{port}"
    try:
        counters = ServerCounters(url)  # the workers' CPU: their serving side's share is the runs' too
        with off_the_workers_cores(n, threads):
            records = asyncio.run(replay(Target(url, model_name(url)), schedule, max_tokens=1, drain_s=120))
        preempted, cpu = counters.stop()
    finally:
        stop(proc)
    workers = [[b._replace(ids=[_sim_id(rid) for rid in b.ids]) for b in bs] for bs in read_workers(logs)]
    failed = sum(not r.ok for r in records)
    pt = report.point(w.rate, outcomes(records), sum((preempted or {}).values())) | {
        "failed": failed, "command": "flowprefill " + " ".join(argv)}
    pt |= overheads(workers, {f"w{r.index}": r.ttft_s for r in records if r.ttft_s is not None and r.ok})
    pt["serving_cpu_ms"] = cpu["serving_s"] * 1000 / len(records) if cpu and records else None
    served = [net_of_serving(bs, (pt["serving_cpu_ms"] or 0.0) / 1000) for bs in workers]
    # Where the workers share their cores with the gateway (two workers on 2 cores), a batch begun idle is
    # also one that ran while the rest of the fleet was quiet, faster: its excess is not the wake-up alone.
    # So it is netted out for one worker (over nine runs' pilots: 53 of 54 cells within 5 points, 50 without)
    # and not for two workers on 2 cores (48 of 54 with it, 50 without).
    wake_s = idle_wake(served) if gateway_cores(n, threads) is not None else None
    pt["idle_wake_ms"] = None if wake_s is None else wake_s * 1000
    batches = [b for bs in served for b in net_of_wake(bs, wake_s or 0.0)]
    return pt, [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)], batches


def gateway_cores(n: int, threads: int | None) -> set[int] | None:
    """The cores `serve --workers n` keeps for its gateway apart from its workers' own, or None where the
    gateway shares theirs (serve's own split of this machine's cores)."""
    from gateway.cli.serve import Cores, worker_threads

    serve_args = argparse.Namespace(device="cpu", cpu_cores=None, workers=n, num_threads=threads)
    cores = Cores.plan(serve_args, worker_threads(serve_args))
    if cores is None or cores.shared & set().union(*cores.own):
        return None
    return set(cores.shared)


@contextmanager
def off_the_workers_cores(n: int, threads: int | None) -> Iterator[None]:
    """The load generator (this process) on the gateway's cores while `serve --workers n` runs, where
    serve pins its workers to cores of their own (it keeps the first core for the gateway when the
    rest hold every worker: on 2 cores, one worker of one thread), as a deployment's clients are not on
    its workers' cores. Unpinned, the replay's own Python shared the one worker's core at 16 req/s.
    (The calling thread is pinned, and so the replay's event loop and any thread it starts.)"""
    shared = gateway_cores(n, threads)
    if shared is None:
        yield  # the gateway shares the workers' cores: nowhere else to go
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, shared)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _start_serve(policy: str, n: int, threads: int | None, logs: Path, tries: int = 3
                 ) -> tuple[subprocess.Popen, int, list[str]]:
    """`serve --workers n` started and healthy, its stderr in `logs/serve-<attempt>.log`. A port free when chosen can
    be taken before serve binds it (the replay's connections come and go on this machine's ports: one of
    four fleets in a run at 16 req/s exited 2, cause unseen); serve then refuses to start, and another
    port is tried. Any other early exit is an error that names serve's own last line."""
    for attempt in range(tries):
        port = free_port(span=n + 1)
        # --no-calibrate: the workers predict with the profile this planner reads (not each a start-up of its
        # own, 13 % apart per operator on 2 EPYC cores), so their logged speeds carry over to its cost model
        # --model tiny: the model the planner's profile is of (an engine's default, not serve's)
        argv = ["serve", "--model", "tiny", "--port", str(port), "--workers", str(n), "--policy", policy,
                "--no-prefix-caching", "--no-calibrate", *(["--threads", str(threads)] if threads else [])]
        log = logs / f"serve-{attempt}.log"  # its own: an earlier attempt's last line is not this one's cause
        proc = start(*argv, env={BATCH_LOG: str(logs)}, stderr_to=log)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=600)
            return proc, port, argv
        except (RuntimeError, TimeoutError) as exc:
            stop(proc)
            why = last_line(log)
            if "in use" in why and attempt + 1 < tries:
                continue
            raise RuntimeError(f"flowprefill {' '.join(argv)}: {exc}: {why} (its log: {log})") from None
        except BaseException:  # interrupted while it starts: it and its workers are not left running
            stop(proc)
            raise
    raise AssertionError("unreachable")


def _sim_id(worker_id: str) -> str:
    """The replay client's `peer-<ns>-<i>` (a worker may add `-<hex>` to a reused id) as the simulation's `w<i>`."""
    parts = worker_id.split("-")
    return f"w{parts[2]}" if len(parts) >= 3 and parts[0] == "peer" and parts[2].isdecimal() else worker_id


class Rounds(NamedTuple):
    """The real fleets' runs, in rounds; the runs that failed to start (per fleet, their causes); and,
    with `--interleave-pilots`, each pilot fleet's runs, one per round, taken just before its real run,
    the causes of those that gave nothing (plan_speed's PilotError), and per real fleet each round in
    which both its own shape's pilot and its run went: the round, the pilot, the run's point
    (engine/bench/plan_paired.py)."""

    runs: dict[tuple[str, int], list[Run]]
    failed: dict[tuple[str, int], list[str]]
    pilots: dict[tuple[str, int], list[PilotRun]]
    pilot_failed: dict[tuple[str, int], list[str]]
    pairs: dict[tuple[str, int], list[Pair]]


def real_rounds(args: argparse.Namespace, w: Workload, policies: list[str], console: Console,
                pilot: Callable[[str, int, int], PilotRun] | None = None,
                pilot_fleets: Sequence[tuple[str, int]] = ()) -> Rounds:
    """Each `--against-serve` fleet run `--repeats` times, every fleet once per round. With `pilot`
    (policy, workers, round -> a pilot run), each of `pilot_fleets` also runs its pilot once per round,
    just before its own real run (a fleet no real one is of, e.g. one worker with `--against-serve 2`,
    first in its policy), so that pilots and fleets meet the same drift of this machine's speed."""
    schedule = arrivals(w)
    fleets = [(policy, n) for policy in policies for n in workers_of(args.against_serve)]
    root = Path(args.out) / "batch-logs"
    for policy, n in fleets:  # an earlier run's logs (its run-<r>/ folders too) are not read as this one's
        shutil.rmtree(root / fleet_name(policy, n), ignore_errors=True)
    piloted = pilot_fleets if pilot is not None else []
    done = Rounds({f: [] for f in fleets}, {f: [] for f in fleets}, {f: [] for f in piloted}, {f: [] for f in piloted},
                  {f: [] for f in fleets})
    order = sorted(set(fleets) | set(piloted), key=lambda f: (policies.index(f[0]), f[1]))
    for r in range(args.repeats):
        for policy, n in order:
            piloted_now = None  # this round's pilot of the fleet's own shape, where it ran
            if pilot is not None and (policy, n) in done.pilots:
                try:
                    piloted_now = pilot(policy, n, r)
                    done.pilots[(policy, n)].append(piloted_now)
                except PilotError as exc:  # its other rounds' pilots still count
                    console.print(f"[red]round {r + 1}'s pilot failed: {exc}[/red]")
                    done.pilot_failed[(policy, n)].append(str(exc))
            if (policy, n) not in done.runs:
                continue
            console.print(f"serve --workers {n} --policy {policy}: {len(schedule)} requests over {w.duration_s:.0f} s"
                          + (f" (run {r + 1} of {args.repeats})" if args.repeats > 1 else ""))
            logs = root / fleet_name(policy, n)
            try:
                done.runs[(policy, n)].append(real_point(policy, n, args.threads, w, schedule,
                                                         logs / f"run-{r + 1}" if args.repeats > 1 else logs))
                if piloted_now is not None:
                    done.pairs[(policy, n)].append((r + 1, piloted_now, done.runs[(policy, n)][-1][0]))
            except RuntimeError as exc:  # serve did not start: the fleet's other runs still count
                console.print(f"[red]run {r + 1} of serve --workers {n} --policy {policy} failed: {exc}[/red]")
                done.failed[(policy, n)].append(str(exc))
    return done


def compare_fleets(args: argparse.Namespace, w: Workload, cost: OpCost, engine_cfg: EngineConfig, rounds: Rounds,
                   planned: Speeds | None) -> list[dict[str, Any]]:
    """Each real fleet's runs (`real_rounds`: with `--repeats R` R of them, in rounds, so that the machine's
    drift falls on every fleet) against its simulations (`compare`, with the median of its runs per class),
    or the causes of its runs' failures. `cost`: the cost model as profiled; `planned`: what the plan
    simulated per policy (at its pilot's or an engine pass's speed), or per fleet where a pilot of its
    shape ran, whose simulation is then the planner's own prediction."""
    schedule = arrivals(w)
    rows = []
    for (policy, n), done in rounds.runs.items():
        errors = rounds.failed[(policy, n)]
        own = own_prediction(planned, policy, n)
        pairs = rounds.pairs[(policy, n)]
        row = compare(args, w, schedule, cost, own, engine_cfg, policy, n, done, pairs) if done else {
            "policy": policy, "workers": n}  # serve never started for it
        rows.append(row | ({"failed_runs": errors} if errors else {}))
    return rows


def own_prediction(speeds: Speeds | None, policy: str, n: int) -> Planned | None:
    """What the planner simulates a fleet of n workers of `policy` with: its shape's own pilot where one
    ran, else the policy's."""
    if speeds is None:
        return None
    return (speeds.fleets or {}).get((policy, n)) or speeds.planned.get(policy)


def compare(args: argparse.Namespace, w: Workload, schedule: list[Arrival], cost: OpCost, planned: Planned | None,
            engine_cfg: EngineConfig, policy: str, n: int,
            runs: list[Run], pairs: Sequence[Pair] = ()) -> dict[str, Any]:
    """One fleet's real runs (their median per class) beside its simulations: with the cost model, as
    planned, each run at the pilot just before it (`pairs`, plan_paired), at the speed the runs measured,
    charged what they measured (their batches pooled: a request's factor is then its seconds summed over
    the runs over its predicted seconds summed)."""
    urls = runs[0][1]  # the workers' names (routing by load alone does not hash them)
    reqs = same_prompts(w, schedule)  # as the simulation names them
    batches = as_simulated([b for _, _, bs in runs for b in bs], reqs)
    planner = Planner(w, copy.deepcopy(cost), engine_cfg, args.target, args.every_class,
                      key_of=None,  # `serve --no-prefix-caching`'s gateway routes by load alone (gateway/cli/serve.py)
                      poll_s=args.poll_s, requests=lambda: same_prompts(w, schedule), urls=lambda _n: urls)
    row: dict[str, Any] = {"policy": policy, "workers": n, "real": median_run([pt for pt, _, _ in runs]),
                           "sim": planner.evaluate(policy, n, stop_early=False)}
    if planned is not None:
        planner.use(planned._replace(cost=copy.deepcopy(planned.cost)))
        row["sim_planned"] = planner.evaluate(policy, n, stop_early=False)
        row["planned_over_real_s"] = planned_over_real(planned.cost, batches)
    if (each := paired(planner, policy, n, cost, pairs)) is not None:
        row["sim_paired"] = each
    # the replays charge what the runs measured: each request's seconds, or their speed per size, with
    # the runs' own host time per batch and time outside the workers
    exact = ExactCosts.from_batches(cost, batches)
    planner.use(planned_with(copy.deepcopy(cost), row["real"]))
    row["sim_measured_costs"] = replayed_runs(planner, policy, n, cost, [bs for _, _, bs in runs], reqs)
    planner.use(planned_with(at_speed(cost, batches, exact.default), row["real"], wander(batches)))  # its speed
    row["sim_measured_speed"] = planner.evaluate(policy, n, stop_early=False)
    row |= {"measured_requests": len(exact.factors), "measured_factor_median": exact.default,
            "measured_factor_by_size": speed_by_size(batches)}
    for run, (_, _, bs) in zip(row["real"].get("runs", []), runs, strict=False):  # one run has no "runs"
        run |= {"measured_factor_median": ExactCosts.from_batches(cost, bs).default,  # each run's own speed
                "measured_factor_by_size": speed_by_size(bs)}
    if args.speed_from is not None:
        row |= at_pilot_speed(planner, cost, Path(args.speed_from), policy, n)
    return row


def same_prompts(w: Workload, schedule: list[Arrival]) -> list[Request]:
    """The workload's requests as the simulation names and classes them, each with the prompt the real
    fleet was sent (`schedule`, the replay client's arrivals)."""
    reqs = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
    for r, a in zip(reqs, schedule, strict=True):
        r.prompt_token_ids = a.prompt
    return reqs


def planned_over_real(planned: OpCost, batches: list[MeasuredBatch]) -> float | None:
    """The real runs' batches at the speed the plan simulated (its factor for each batch's size) over the
    seconds they took: how far the plan's speed was off on the runs' own sizes. A median factor over
    requests compares mixes, not speeds: the pilot sends the workload's first 100 requests, the runs 200,
    and at the same speed per size a mix with more short batches reads slower (pilots that read 7-17 %
    slower that way were 2.5-13 % faster on the runs' own batches)."""
    sized = [b for b in batches if b.tokens and b.exec_s > 0]
    took = sum(b.exec_s for b in sized)
    return sum(b.base_s * planned.scale * planned.factor(b.tokens) for b in sized) / took if took else None


def as_simulated(batches: list[MeasuredBatch], reqs: list[Request]) -> list[MeasuredBatch]:
    """The batches with their requests named as the simulation names them (`reqs`, in the schedule's
    order): the workers log the client's x-request-id, which ExactCosts would not find, and every
    request would be charged the runs' median factor instead of its own cost."""
    def named(rid: str) -> str:
        k = arrival_index(rid)
        return reqs[k].request_id if k is not None and k < len(reqs) else rid

    return [b._replace(ids=[named(rid) for rid in b.ids]) for b in batches]


def replayed_runs(planner: Planner, policy: str, n: int, cost: OpCost, runs: list[list[MeasuredBatch]],
                  reqs: list[Request]) -> dict[str, Any]:
    """Each real run replayed with its own requests' measured costs, and their median per class, as the
    real runs' (`median_run`): pooled over the runs, a request's cost is its mean over moments the
    machine ran at different speeds, and a run's attainment at its knee is decided by when it was slow
    (one `chunked:2048` worker at 5.5 req/s on a 2-core Xeon: each run alone within 1.3 points of its
    real one on average)."""
    points = [planner.evaluate(policy, n, stop_early=False, exact=ExactCosts.from_batches(cost, as_simulated(bs, reqs)))
              for bs in runs]
    return median_run([pt | {"failed": 0, "command": None} for pt in points])


def median_run(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one fleet as one point: per class and overall the median attainment (and TTFT
    percentiles), each run's own attainments kept under `runs`. One run is itself."""
    if len(points) == 1:
        return points[0]
    per_class = {}
    for c, first in points[0]["per_class"].items():
        mine = [p["per_class"][c] for p in points]
        per_class[c] = {"n": first["n"], "attainment": statistics.median(x["attainment"] for x in mine),
                        "median_interval": median_interval([x["attainment"] for x in mine])} | {
            k: statistics.median(x[k] for x in mine) if all(x[k] is not None for x in mine) else None
            for k in ("ttft_p50_ms", "ttft_p99_ms")}
    attainment = statistics.median(p["attainment"] for p in points)
    return {"rate": points[0]["rate"], "attainment": attainment, "goodput_rps": points[0]["rate"] * attainment,
            "median_interval": median_interval([p["attainment"] for p in points]),
            "per_class": per_class, "preemptions": statistics.median(p["preemptions"] for p in points),
            "failed": sum(p["failed"] for p in points), "command": points[0]["command"],
            **median_overheads(points),
            "runs": [{"attainment": p["attainment"], "failed": p["failed"],
                      "per_class": {c: x["attainment"] for c, x in p["per_class"].items()}} for p in points]}


MEDIAN_LEVEL = 0.9  # the real median's interval: 90 %, by bootstrap over the runs
BOOTSTRAP_DRAWS = 2000  # resamples: the interval's ends move under 0.5 points between seeds for nine runs


def median_interval(xs: list[float], level: float = MEDIAN_LEVEL, draws: int = BOOTSTRAP_DRAWS) -> list[float]:
    """How well `xs`' median is known: the central `level` of the medians of `draws` resamples of `xs`
    with replacement (a fixed seed, so one plan.json reads the same twice). On this shared 2-core VM,
    nine runs of one overloaded `chunked:2048` worker at 5.5 req/s ran 46-79 %: their median is known
    to 57.5-77.5, wider than the 5-point target: a plan can miss it by more than 5 and be right."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    tail = (1 - level) / 2
    return [medians[int(tail * draws)], medians[min(draws - 1, int((1 - tail) * draws))]]


def pilot_folder(pilot: Path, policy: str, n: int) -> Path:
    own = pilot / fleet_name(policy, n)
    return own if any(own.rglob("batches-*.jsonl")) else pilot


def at_pilot_speed(planner: Planner, cost: OpCost, pilot: Path, policy: str, n: int) -> dict[str, Any]:
    """The fleet simulated at the speed a pilot measured: its run of the same fleet where it has one
    (an earlier --against-serve's `batch-logs/<policy>-w<n>/`), else all its logs."""
    folder = pilot_folder(pilot, policy, n)
    at, measured = measured_speed(cost, folder)
    planner.use(planned_at(at, measured))
    return {"sim_pilot_speed": planner.evaluate(policy, n, stop_early=False), "pilot": {"from": str(folder)} | measured}
