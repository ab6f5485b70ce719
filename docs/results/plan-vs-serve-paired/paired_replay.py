"""Ad hoc: stored `plan --against-serve --repeats R --interleave-pilots` runs replayed with each round's real
run predicted from that round's pilot alone (its speed per size; the pilots' overheads and wander pooled, as
plan.json keeps them), against the pooled plan the run printed. Per fleet and cell: the stored gap (pooled
plan - the runs' median), the pooled plan replayed, and the median over rounds of (round's prediction -
round's run). Written before `plan_paired` existed, which now does the paired part in `plan` itself (there
each round also takes its own pilot's overheads and wander, which plan.json does not keep per round).

The cost profile cached on this machine moves as start-ups join it, and the runs' batch logs hold their
seconds as predicted under the profile of their day: each run's logged seconds are rescaled to today's
profile by the median ratio over its one-request `flowprefill` batches (1.21-1.25 on 2026-12-06 at noon),
without which every replay is that much slow (a `chunked:2048` worker's round planned at 19 % that ran 40).

    tar xzf docs/results/plan-vs-serve-wander/logs-0334-0529-0613.tar.gz -C /tmp/runs
    .venv/bin/python docs/results/plan-vs-serve-paired/paired_replay.py <run folder> <out.json>
"""

from __future__ import annotations

import copy
import json
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.batch_log import MeasuredBatch, read
from engine.bench.plan import build_parser, load_workload
from engine.bench.plan_fleet import Planner
from engine.bench.plan_measured import planned_with, wander
from engine.bench.plan_real import fleet_name, same_prompts
from engine.config import EngineConfig
from engine.model.plan import OpCost, SeqSpan
from engine.sim.oracle import at_speed
from loadtest.goodput import Runner
from loadtest.peer.client import arrival_index, arrivals

CELLS = ("interactive", "standard")


def cells(pt: dict[str, Any]) -> list[float]:
    return [pt["per_class"][c]["attainment"] for c in CELLS] + [pt["attainment"]]


def run_cells(run: dict[str, Any]) -> list[float]:
    return [run["per_class"][c] for c in CELLS] + [run["attainment"]]


def profile_ratio(root: Path, cost: OpCost, schedule: list[Any]) -> float:
    """Today's profile over the one the run was planned with: one-request `flowprefill` batches that
    computed their whole prompt, their seconds under today's profile over those logged."""
    ratios = []
    for sub in ("pilot/flowprefill-w1", "batch-logs/flowprefill-w1"):
        for b in read(root / sub):
            k = arrival_index(b.ids[0]) if len(b.ids) == 1 else None
            if k is not None and b.tokens == len(schedule[k].prompt):
                ratios.append(cost.prefill_s([SeqSpan(0, b.tokens)]) / b.base_s)
    return statistics.median(ratios)


def main(root: Path, out: Path) -> None:
    doc = json.loads((root / "plan.json").read_text())
    args = build_parser().parse_args(shlex.split(doc["command"])[2:])
    w = load_workload(args)
    schedule = arrivals(w)
    engine_cfg = EngineConfig(prefix_caching=False, num_threads=args.threads)
    cost = Runner("sim", engine_cfg, "cpu").cost
    ratio = profile_ratio(root, cost, schedule)
    print(f"today's profile over the run's: {ratio:.3f}")

    def speed(batches: list[MeasuredBatch]) -> OpCost:
        at = at_speed(cost, batches, 1.0)
        return replace(at, class_scale=[f / ratio for f in at.class_scale],
                       class_first=[[f / ratio] for f in at.class_scale])

    fleets, tally = [], {"stored": [], "replayed_pooled": [], "paired_median": []}
    for row in doc["against_serve"]:
        policy, n, real = row["policy"], row["workers"], row["real"]
        name = fleet_name(policy, n)
        planner = Planner(w, copy.deepcopy(cost), engine_cfg, args.target, args.every_class, key_of=None,
                          poll_s=args.poll_s, requests=lambda: same_prompts(w, schedule),
                          urls=lambda k: [f"http://w{i}" for i in range(k)])
        said = doc["pilot"][policy] if n == 1 else doc["pilot"][policy]["fleets"][str(n)]
        pilots = read(root / "pilot" / name)
        strayed = wander(pilots)
        planner.use(planned_with(speed(pilots), said, strayed))
        planned = cells(planner.evaluate(policy, n, stop_early=False))
        pooled = [100 * (a - b) for a, b in zip(planned, cells(real), strict=True)]
        per_round = []
        for r in range(1, len(real["runs"]) + 1):
            planner.use(planned_with(speed(read(root / "pilot" / name / f"run-{r}")), said, strayed))
            per_round.append(cells(planner.evaluate(policy, n, stop_early=False)))
        gaps = [[100 * (p - q) for p, q in zip(plan, run_cells(run), strict=True)]
                for plan, run in zip(per_round, real["runs"], strict=True)]
        paired = [statistics.median(g[i] for g in gaps) for i in range(3)]
        stored = [100 * (a - b) for a, b in zip(cells(row["sim_planned"]), cells(real), strict=True)]
        for key, xs in (("stored", stored), ("replayed_pooled", pooled), ("paired_median", paired)):
            tally[key] += xs
        print(f"{name:16s} stored {'/'.join(f'{x:+6.1f}' for x in stored)}  replayed pooled "
              f"{'/'.join(f'{x:+6.1f}' for x in pooled)}  paired median {'/'.join(f'{x:+6.1f}' for x in paired)}")
        fleets.append({"fleet": name, "per_round_plan": per_round, "runs": [run_cells(r) for r in real["runs"]],
                       "paired_gaps": gaps, "paired_median": paired, "replayed_pooled_gap": pooled,
                       "stored_gap": stored})
    for key, xs in tally.items():
        print(f"{key}: {sum(abs(x) <= 5 for x in xs)}/{len(xs)} within 5, mean |gap| "
              f"{statistics.fmean(abs(x) for x in xs):.1f}")
    out.write_text(json.dumps({"source": str(root), "profile_ratio": ratio, "fleets": fleets}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
