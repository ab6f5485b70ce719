"""`flowprefill bench planner --against-serve N,N`: the planner's fleet against the real one on this machine
(a benchmark of the planner, engine/planner/, not part of it).

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
(engine/planner/speed.py): that fleet, "as planned", is the planner's own prediction. `--repeats R`
runs each real fleet R times, in rounds, and compares with the median of its runs per class (each run's
logs in `run-<r>/`); with `--interleave-pilots` each round also runs each fleet's pilot just before its real
run (`real_rounds`), and the plan is made after the rounds, at their pilots pooled.
"""

from __future__ import annotations

import argparse
import copy
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console

from engine.bench.planner_validation.median import median_run
from engine.bench.planner_validation.paired import Pair, paired
from engine.core.batch_log import MeasuredBatch
from engine.core.config import EngineConfig
from engine.core.request import Request
from engine.model.cost import OpCost
from engine.planner import serve_runs, speed
from engine.planner.fleet import Planner
from engine.planner.measured import Planned, planned_at, planned_with, wander
from engine.planner.serve_runs import Run, fleet_name
from engine.planner.speed import PilotError, PilotRun, Speeds, from_pilots, measured_speed, pilot_fleets, pooled
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim.oracle import ExactCosts, at_speed, speed_by_size
from loadtest.goodput import make_requests
from loadtest.peer.client import Arrival, arrival_index, arrivals
from loadtest.workload import Workload


def workers_of(spec: str) -> list[int]:
    try:
        ns = [int(x) for x in spec.split(",") if x]
    except ValueError:
        raise ValueError(f"--against-serve {spec!r}: expected worker counts, e.g. 1,2") from None
    if not ns or min(ns) < 1:
        raise ValueError(f"--against-serve {spec!r}: expected worker counts >= 1, e.g. 1,2")
    return ns


class Rounds(NamedTuple):
    """The real fleets' runs, in rounds; the runs that failed to start (per fleet, their causes); and,
    with `--interleave-pilots`, each pilot fleet's runs, one per round, taken just before its real run,
    the causes of those that gave nothing (engine/planner/speed.py's PilotError), and per real fleet each round in
    which both its own shape's pilot and its run went: the round, the pilot, the run's point
    (paired.py)."""

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
                done.runs[(policy, n)].append(serve_runs.real_point(policy, n, args.threads, w, schedule,
                                                         logs / f"run-{r + 1}" if args.repeats > 1 else logs))
                if piloted_now is not None:
                    done.pairs[(policy, n)].append((r + 1, piloted_now, done.runs[(policy, n)][-1][0]))
            except RuntimeError as exc:  # serve did not start: the fleet's other runs still count
                console.print(f"[red]run {r + 1} of serve --workers {n} --policy {policy} failed: {exc}[/red]")
                done.failed[(policy, n)].append(str(exc))
    return done


def interleaved_pilots(args: argparse.Namespace, w: Workload, pilot: Callable[[], tuple[Workload, str]], cost: OpCost,
                       policies: list[str], console: Console) -> tuple[Speeds, Rounds]:
    """`--interleave-pilots`: the pilots run in `--against-serve`'s rounds, each fleet's once per round
    just before its real run, not all before the plan: on a shared 2-core machine the speed can move a
    fifth between pilots and the fleets they plan minutes later (then 4 of 12 cells within 5 points, all
    pessimistic, where the runs' own speed put all 12 within 5). The plan's speeds (`from_pilots`, each
    fleet's round runs pooled) and the real rounds (`Rounds`) to compare them with."""
    sent, where = pilot()

    def one(policy: str, n: int, r: int) -> PilotRun:
        folder = Path(args.out) / "pilot" / fleet_name(policy, n)
        if r == 0:
            shutil.rmtree(folder, ignore_errors=True)  # an earlier pilot's run-<r>/ folders are not this one's
        console.print(f"pilot: serve --workers {n} --policy {policy}, {where}, over {sent.duration_s:.0f} s "
                      f"(round {r + 1} of {args.repeats})")
        return speed.serve_pilot(policy, args.threads, sent, folder / f"run-{r + 1}", n)

    fleets = pilot_fleets(policies, workers_of(args.against_serve))
    rounds = real_rounds(args, w, policies, console, one, fleets)
    for policy, n in fleets:
        if not rounds.pilots[(policy, n)]:  # every round's failed: the last one's cause
            raise PilotError(rounds.pilot_failed[(policy, n)][-1])
    ran = {(p, n): pooled(rounds.pilots[(p, n)], Path(args.out) / "pilot" / fleet_name(p, n)) for p, n in fleets}
    return from_pilots(cost, ran, where, console), rounds


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
    planned, each run at the pilot just before it (`pairs`, paired.py), at the speed the runs measured,
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
