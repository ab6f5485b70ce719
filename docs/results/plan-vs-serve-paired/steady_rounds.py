"""Ad hoc: for `plan --against-serve --interleave-pilots` runs with `sim_paired`, each round's pilot speed on
its run's own batches (`plan_real.planned_over_real`: the run's batches at the pilot's speed per size over
what they took) beside that round's gaps (prediction - run: overall, `interactive`, `standard`), and the
gaps counted apart where the pilot was within 15 % of its run's speed and where the machine moved more.

    tar xzf docs/results/plan-vs-serve-paired/logs-c5-c6.tar.gz -C /tmp/runs
    cp docs/results/plan-vs-serve-paired/c5/plan.json /tmp/runs/c5/ (and c6)
    .venv/bin/python docs/results/plan-vs-serve-paired/steady_rounds.py /tmp/runs/c5 /tmp/runs/c6
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from engine.batch_log import read
from engine.bench.plan_real import fleet_name, planned_over_real
from engine.config import EngineConfig
from engine.sim.oracle import at_speed
from loadtest.goodput import Runner

STEADY = 0.85  # a pilot within 15 % of its run's speed, either way


def main(roots: list[Path]) -> None:
    cost = Runner("sim", EngineConfig(prefix_caching=False, num_threads=1), "cpu").cost
    steady: list[float] = []
    moved: list[float] = []
    for root in roots:
        doc = json.loads((root / "plan.json").read_text())
        for row in doc["against_serve"]:
            name = fleet_name(row["policy"], row["workers"])
            for r in row["sim_paired"]["rounds"]:
                k = r["round"]
                pilot = at_speed(cost, read(root / "pilot" / name / f"run-{k}"), 1.0)
                ratio = planned_over_real(pilot, read(root / "batch-logs" / name / f"run-{k}")) or 1.0
                gaps = [100 * (r["attainment"] - r["real"])] + [
                    100 * (x["attainment"] - x["real"]) for c, x in r["per_class"].items()
                    if c in ("interactive", "standard")]
                (steady if STEADY <= ratio <= 1 / STEADY else moved).extend(gaps)
                print(root.name, name, k, f"{ratio:.2f}", " ".join(f"{g:+.0f}" for g in gaps))
    for label, gaps in (("pilot within 15 % of its run's speed", steady), ("the speed moved more", moved)):
        print(f"{label}: {len(gaps)} cells, {sum(abs(g) <= 5 + 1e-9 for g in gaps)} within 5, "
              f"median |gap| {statistics.median(abs(g) for g in gaps):.1f}")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
