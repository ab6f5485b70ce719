"""`plan --against-serve --interleave-pilots`: each real run against the plan made at the pilot just before it.

On a shared machine whose speed moves, the median of a fleet's runs at its knee is itself a draw: on this
2-core Xeon (2026-12-06) one `chunked:2048` worker at 5.5 req/s ran 42-55 % in the minutes the machine was
slow and 96-98 % in the others, so nine runs put their median on either side, and a plan at the pilots'
pooled speed can be right and miss it by 20 points. What a planner is for is the fleet at the speed the
machine has: in each round the pilot runs just before the fleet (other requests: with `--skip` ones the
runs never send), and the fleet's run is predicted from that pilot alone (its speed per size, its time
outside the batches, how its batches strayed), a pair per round. The fleet's error is the median over the
rounds of prediction minus run, per class: a round the machine changed speed in between is one outlier,
not the verdict. Replayed over the four stored nine-round comparisons of that day (their logged seconds
rescaled to the profile they were planned with, `measured_profile`): 45 of 48 cells within 5 points,
against 35 for the pooled plan against the runs' median; the three misses were one fleet (one
`chunked:2048` worker, out of sample) whose pilots ran slower than the runs after them in most rounds.
Then pre-registered: 12 of 12 out of sample (largest gap -2.4, where the pooled plan missed one worker by
40 points), 11 of 12 in sample (two `flowprefill` workers' `standard`, +5.7), 11 of 12 out of sample again
(two `chunked:2048` workers' `standard`, +5.2; the pooled plan 3). Over those 27 rounds per fleet every
cell's median gap is within 1.1 points: what misses is the scatter of a median of nine rounds (a
`standard` cell with no bias lands past 5 in 10-16 % of runs), and every cell of a run within 5 asks
some 24 rounds of this machine (docs/results/plan-vs-serve-paired/rounds_needed.py). At 18 rounds, one
policy a run, pre-registered and out of sample: `flowprefill` 6 of 6 (largest -2.9), `chunked:2048` 6 of
6 (largest +1.7, in an hour whose last four rounds ran 2-3x faster; the pooled plan missed 4 of 8 by up
to 24); `flowprefill` again, every class of >= 20 requests counted, 8 of 8 (largest +4.3). A
single run is another matter: 188 of the three nine-round runs' 324 cells within 5 points, the
rest off by up to 50 where the speed moved in between.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from engine.bench.plan_fleet import Planner
from engine.bench.plan_speed import PilotRun, planned_from
from engine.model.plan import OpCost

Pair = tuple[int, PilotRun, dict[str, Any]]  # a round: its number, its pilot, its real run's goodput point


def paired(planner: Planner, policy: str, n: int, cost: OpCost, pairs: Sequence[Pair]) -> dict[str, Any] | None:
    """Each round's real run beside the fleet simulated at its round's pilot (`planned_from`): per class
    and overall, the median of those predictions, and the median of prediction minus run (`median_gap`)
    with its 90 % bootstrap interval (`gap_interval`: how well the rounds know it). None: no round had
    both."""
    from engine.bench.plan_real import median_interval

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
