"""Ad hoc: the real medians' 90 % intervals (`plan_real.median_interval`) for stored `plan --against-serve
--repeats R` runs, and per run the cells the planner's own prediction missed by more than 5 points, inside or
beyond the interval widened by 5 (`plan_report`'s verdict), as `plan` now prints them itself; plan.json files
from before it kept the intervals are read from their runs.

    .venv/bin/python docs/results/plan-vs-serve-intervals/intervals.py \\
        docs/results/plan-vs-serve-wander/c1/plan.json docs/results/plan-vs-serve-wander/c2/plan.json \\
        docs/results/plan-vs-serve-intervals/c3/plan.json docs/results/plan-vs-serve-intervals/c4/plan.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from engine.bench.plan_real import median_interval
from engine.bench.plan_report import AGREEMENT_BAND, _beyond

CELLS = ("interactive", "standard", "all")


def main(paths: list[str]) -> None:
    cells = within = beyond = narrow = narrow_within = 0
    for path in paths:
        doc = json.loads(Path(path).read_text())
        print(path)
        for row in doc["against_serve"]:
            line = []
            for c in CELLS:
                runs = [r["attainment"] if c == "all" else r["per_class"][c] for r in row["real"]["runs"]]
                real, (lo, hi) = statistics.median(runs), median_interval(runs)
                got = row["sim_planned"]
                planned = got["attainment"] if c == "all" else got["per_class"][c]["attainment"]
                ok, out = abs(planned - real) <= AGREEMENT_BAND + 1e-9, _beyond(planned, (lo, hi))
                cells, within, beyond = cells + 1, within + ok, beyond + out
                if hi - lo <= 2 * AGREEMENT_BAND + 1e-9:
                    narrow, narrow_within = narrow + 1, narrow_within + ok
                line.append(f"{c} {100 * (planned - real):+.1f} [{100 * lo:.1f}-{100 * hi:.1f}]"
                            + (" beyond" if out else ""))
            print(f"  {row['policy']} on {row['workers']}: " + "; ".join(line))
    print(f"{within} of {cells} cells within 5 points; {beyond} beyond 5 points of the real median's 90 % interval; "
          f"where the interval is at most 10 points wide, {narrow_within} of {narrow}")


if __name__ == "__main__":
    main(sys.argv[1:])
