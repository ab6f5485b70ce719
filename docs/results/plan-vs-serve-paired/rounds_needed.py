"""Ad hoc: how many rounds the paired verdict needs on this machine. From stored `plan --against-serve
--interleave-pilots` runs (their plan.json's `sim_paired` rounds: each round's prediction beside its run),
per counted cell (each fleet's `interactive`, `standard` and overall) the rounds' gaps pooled over the
runs; then, drawing R rounds with replacement, how often a run would have every cell's median gap within
5 points: as the gaps were seen, and centred on each cell's median (a planner with no bias at all, the
same scatter). Pure Python: reads the JSON only.

    python3 docs/results/plan-vs-serve-paired/rounds_needed.py docs/results/plan-vs-serve-paired/c{5,6,7}/plan.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

CELLS = ("interactive", "standard", None)  # None: overall
BAND = 5.0
DRAWS = 4000


def gaps(paths: list[str]) -> dict[tuple[str, int, str], list[float]]:
    out: dict[tuple[str, int, str], list[float]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["against_serve"]:
            for r in row["sim_paired"]["rounds"]:
                for cell in CELLS:
                    x = r if cell is None else r["per_class"][cell]
                    out.setdefault((row["policy"], row["workers"], cell or "overall"), []).append(
                        100 * (x["attainment"] - x["real"]))
    return out


def all_within(cells: dict[tuple[str, int, str], list[float]], rounds: int, centred: bool, rng: random.Random) -> float:
    shift = {k: statistics.median(v) if centred else 0.0 for k, v in cells.items()}
    met = sum(all(abs(statistics.median(rng.choice(v) - shift[k] for _ in range(rounds))) <= BAND + 1e-9
                  for k, v in cells.items()) for _ in range(DRAWS))
    return met / DRAWS


def main(paths: list[str]) -> None:
    cells = gaps(paths)
    rng = random.Random(1)
    print(f"{len(cells)} cells, {min(map(len, cells.values()))} rounds each; per cell the rounds' median gap and "
          "its sd, and how often nine rounds with no bias put the cell's median past 5 points:")
    for k, v in cells.items():
        alone = {k: [x - statistics.median(v) for x in v]}
        print(f"  {k[0]} x{k[1]} {k[2]}: median {statistics.median(v):+.1f}, sd {statistics.pstdev(v):.1f}, "
              f"past 5: {1 - all_within(alone, 9, False, rng):.2f}")
    print("rounds  P(every cell within 5) as seen / with no bias;  both of two runs, as seen")
    for rounds in (9, 12, 15, 18, 24):
        seen, unbiased = (all_within(cells, rounds, c, rng) for c in (False, True))
        print(f"{rounds:6d}  {seen:.2f} / {unbiased:.2f};  {seen * seen:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
