"""Ad hoc replay of a stored `flowprefill plan --against-serve ... --repeats R --interleave-pilots` run
(its plan.json, batch-logs/ and pilot/), on this machine's profile, no real run:

1. each real run replayed alone: at its own speed per batch size (constant) and request-exact (each
   request charged what it measured in that run), against that run's real attainment;
2. the planner's own prediction from the stored pilots, with each batch's spread alone and with the
   fitted wander (batch + drift), against the real medians.

    tar xzf docs/results/plan-vs-serve-wander/logs-0334-0529-0613.tar.gz -C /tmp
    .venv/bin/python docs/results/plan-vs-serve-wander/replay_runs.py /tmp/s13/e1   # or s14/c1, s14/c2

The planner's own prediction is replayed from the pilots' logs as stored, not net of the serving side's
CPU as the command takes them, on this machine's profile of the day: within 1.8 points of the stored
prediction at 5.5 req/s on 2026-12-06.
"""

from __future__ import annotations

import copy
import json
import shlex
import statistics
import sys
from pathlib import Path

from engine.batch_log import read
from engine.bench.plan import build_parser, load_workload
from engine.bench.plan_fleet import Planner
from engine.bench.plan_measured import planned_with, spread, wander
from engine.bench.plan_real import as_simulated, fleet_name
from engine.config import EngineConfig
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim.oracle import ExactCosts, at_speed
from loadtest.goodput import Runner, make_requests
from loadtest.peer.client import arrivals

CELLS = ("interactive", "standard")


def gaps(pt: dict, real: dict) -> list[float]:
    return [100 * (pt["per_class"][c]["attainment"] - real["per_class"][c]["attainment"]) for c in CELLS] + [
        100 * (pt["attainment"] - real["attainment"])]


def main(root: Path) -> None:
    d = json.loads((root / "plan.json").read_text())
    args = build_parser().parse_args(shlex.split(d["command"])[2:])
    w = load_workload(args)
    schedule = arrivals(w)
    engine_cfg = EngineConfig(prefix_caching=False, num_threads=args.threads)
    cost = Runner("sim", engine_cfg, "cpu").cost

    def same_prompts() -> list:
        reqs = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
        for r, a in zip(reqs, schedule, strict=True):
            r.prompt_token_ids = a.prompt
        return reqs

    planned_cells: dict[str, list[float]] = {"spread": [], "wander": []}
    for v in d["against_serve"]:
        policy, n, real = v["policy"], v["workers"], v["real"]
        name = fleet_name(policy, n)
        planner = Planner(w, copy.deepcopy(cost), engine_cfg, args.target, args.every_class, key_of=None,
                          poll_s=args.poll_s, requests=same_prompts, urls=lambda k: [f"http://w{i}" for i in range(k)])
        own, exact_gaps = [], []
        for r, run in enumerate(real["runs"], 1):
            bs = as_simulated(read(root / "batch-logs" / name / f"run-{r}"), same_prompts())
            exact = ExactCosts.from_batches(cost, bs)
            planner.use(planned_with(at_speed(cost, bs, exact.default), real, spread(bs)))
            own.append(100 * (planner.evaluate(policy, n, stop_early=False)["attainment"] - run["attainment"]))
            planner.use(planned_with(copy.deepcopy(cost), real))
            pt = planner.evaluate(policy, n, stop_early=False, exact=exact)
            exact_gaps.append(100 * (pt["attainment"] - run["attainment"]))
        print(f"{name}: real runs {100 * min(x['attainment'] for x in real['runs']):.1f}-"
              f"{100 * max(x['attainment'] for x in real['runs']):.1f}; request-exact - real: median "
              f"{statistics.median(exact_gaps):+.1f} mean {statistics.fmean(exact_gaps):+.1f}; "
              f"own speed per size - real: median {statistics.median(own):+.1f} mean {statistics.fmean(own):+.1f} "
              f"sd {statistics.pstdev(own):.1f}")
        said = d["pilot"][policy] if n == 1 else d["pilot"][policy]["fleets"][str(n)]
        pilots = read(root / "pilot" / name)
        at = at_speed(cost, pilots, ExactCosts.from_batches(cost, pilots).default)
        line = []
        for label, strays in (("spread", spread(pilots)), ("wander", wander(pilots))):
            planner.use(planned_with(copy.deepcopy(at), said, strays))
            g = gaps(planner.evaluate(policy, n, stop_early=False), real)
            planned_cells[label] += g
            line.append(f"{label} " + "/".join(f"{x:+.1f}" for x in g))
        print(f"  as planned (interactive/standard/overall - real median): {'  '.join(line)}; "
              f"wander {wander(pilots)}", flush=True)
    for label, g in planned_cells.items():
        print(f"as planned with the {label}: {sum(abs(x) <= 5 for x in g)} of {len(g)} cells within 5, "
              f"mean |gap| {statistics.fmean(abs(x) for x in g):.1f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
