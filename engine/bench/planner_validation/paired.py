"""`bench planner --interleave-pilots`: each real run against the plan made at the pilot just before it.

On a shared machine whose speed moves, the median of a fleet's runs at its knee is itself a draw: one
`chunked:2048` worker at 5.5 req/s on a 2-core Xeon met 42-55 % of its targets while the machine was slow
and 96-98 % while it was fast, so a plan at the pilots' pooled speed can be right and miss nine runs' median
by 20 points. What a planner is for is the fleet at the speed the machine has: in each round the pilot runs
just before the fleet (on other requests: with `--skip`, ones the runs never send), and the fleet's run is
predicted from that pilot alone (its speed per size, its time outside the batches, how its batches strayed),
a pair per round. The fleet's error is the median over the rounds of prediction minus run, per class: a round
in which the machine changed speed between pilot and run is one outlier, not the verdict.

The median of nine rounds still scatters (a `standard` cell with no bias lands past 5 points in 10-16 % of
runs): every cell of a run within 5 points takes some 18-24 rounds on such a machine, and 18 did it in
pre-registered out-of-sample runs of each policy (largest gaps -2.9, +1.7 and +4.3 points). A single run is
predicted within 5 points about two times in three; the rest are off by up to 50 where the speed moved
between pilot and run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from engine.bench.planner_validation.median import median_interval
from engine.model.cost import OpCost
from engine.planner.fleet import Planner
from engine.planner.speed import PilotRun, planned_from

Pair = tuple[int, PilotRun, dict[str, Any]]  # a round: its number, its pilot, its real run's goodput point


def paired(planner: Planner, policy: str, n: int, cost: OpCost, pairs: Sequence[Pair]) -> dict[str, Any] | None:
    """Each round's real run beside the fleet simulated at its round's pilot (`planned_from`): per class
    and overall, the median of those predictions, and the median of prediction minus run (`median_gap`)
    with its 90 % bootstrap interval (`gap_interval`: how well the rounds know it). None: no round had
    both."""
    if not pairs:
        return None
    rounds = []
    for r, pilot, real in pairs:
        planner.use(planned_from(cost, pilot)[0])
        sim = planner.evaluate(policy, n, stop_early=False)
        rounds.append({"round": r, "attainment": sim["attainment"], "real": real["attainment"],
                       "per_class": {c: {"attainment": x["attainment"], "real": real["per_class"][c]["attainment"]}
                                     for c, x in sim["per_class"].items() if c in real["per_class"]}})

    def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
        gaps = [x["attainment"] - x["real"] for x in cells]
        return {"attainment": statistics.median(x["attainment"] for x in cells),
                "median_gap": statistics.median(gaps), "gap_interval": median_interval(gaps)}

    classes = set.intersection(*(set(x["per_class"]) for x in rounds))
    return summary(rounds) | {"per_class": {c: summary([x["per_class"][c] for x in rounds]) for c in sorted(classes)},
                              "rounds": rounds}
