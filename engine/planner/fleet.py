"""The planner's fleets: a workload simulated on N instances of a policy behind the gateway's own routing
(engine/sim/fleet.py), judged against an attainment target, and the smallest N that meets it.
`flowprefill plan` (engine/planner/command.py) asks it per policy; `flowprefill bench planner`
(engine/bench/planner_validation/) sets a fleet beside the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.core.config import EngineConfig
from engine.core.request import Request
from engine.model.cost import OpCost
from engine.planner.measured import Planned
from engine.planner.routing import GatewayRouter, KeyOf
from engine.protocol.slo import DEFAULT_CLASSES, SLOClass
from engine.sim.errors import PredictionError
from engine.sim.fleet import Fleet
from engine.sim.oracle import ExactCosts
from loadtest import report
from loadtest.goodput import make_requests, outcomes, sim_config
from loadtest.workload import PREFIX_BLOCK_TOKENS, Workload

# A run is stopped once its certain misses put it this far below the target: it fails either way, and
# an overloaded fleet (a queue of thousands, at the policy's cost per decision) is the slowest to finish.
STOP_BELOW = 0.25
# With noise (a pilot's spread of batch speeds), a fleet is simulated this many times, each with its own
# draws and its own phase of the gateway's polls (evenly spaced over a poll interval), and judged on them
# pooled. Two `flowprefill` workers on 200 azure-mix requests at 16 req/s: one draw's attainment ranged over
# 78.5-96 %, as the real fleet's runs did over 71-92.5 %; the pooled value's own error (30 repeats) had a
# standard deviation of 2.9 points with five draws at random phases, 1.8 with five evenly spaced, 1.0 with ten.
NOISE_DRAWS = 10


class Planner:
    """Simulates the workload on N instances of a policy. `cost`: the cost model; `key_of`: each
    request's prefix key as the gateway would compute it; `urls`: the instances' names; `outside_s`:
    each request's time outside the instances' batches, out of its TTFT budget, `noise`: the spread of
    batches' speeds around the cost model's, `serving_s`: the CPU an arrival takes from the step it
    lands in, and `idle_wake_s`: what a batch begun on an idle instance takes more (all
    measured.Planned's)."""

    def __init__(self, w: Workload, cost: OpCost, engine_cfg: EngineConfig, target: float, every_class: bool,
                 classes: dict[str, SLOClass] = DEFAULT_CLASSES, key_of: KeyOf | None = None,
                 poll_s: float = 1.0, requests: Callable[[], list[Request]] | None = None,
                 urls: Callable[[int], list[str]] | None = None) -> None:
        self.w, self.cost, self.engine_cfg, self.classes = w, cost, engine_cfg, classes
        self.target, self.every_class = target, every_class
        self.key_of, self.poll_s, self.urls = key_of, poll_s, urls
        self.requests = requests or (lambda: with_prefixes(w, make_requests(w, classes, 1.0, 0.0, None)))
        self.prefix_blocks = PREFIX_BLOCK_TOKENS if any(r.prefix for r in w.requests) else None
        self.sheddable = frozenset(name for name, c in classes.items() if c.sheddable)
        self.outside_s = self.noise = self.serving_s = self.idle_wake_s = self.drift = self.drift_s = 0.0
        self.sims = 0

    def use(self, planned: Planned) -> None:
        """Simulate with `planned`'s cost model, time outside the instances, noise, serving CPU and idle wake-up
        from now on."""
        (self.cost, self.outside_s, self.noise, self.serving_s, self.idle_wake_s, self.drift,
         self.drift_s) = planned

    def evaluate(self, policy: str, n: int, stop_early: bool = True, exact: ExactCosts | None = None) -> dict[str, Any]:
        """One fleet of n instances on the whole workload: the goodput point (bench goodput's, with
        goodput per class), or, stopped early, the most attainment it could still have reached.
        `exact`: charge and predict each request what a real run measured (engine/sim/oracle.py). With
        `noise`, the workload runs `NOISE_DRAWS` times, each with its own draws and its own phase of the
        gateway's polls, and the point pools them."""
        draws = NOISE_DRAWS if (self.noise or self.drift) and exact is None else 1
        done: list[Request] = []
        missed: dict[str, int] = {}  # by class, in the draws run so far
        preemptions = refused = matched = 0
        for seed in range(draws):
            ran = self._run(policy, n, seed, stop_early, exact, missed, draws)
            if isinstance(ran, dict):
                return ran  # stopped early: even the draws to come, all met, could not lift it to the floor
            reqs, fleet, router = ran
            done += reqs
            for r in reqs:
                if r.ttft is None or r.ttft > r.ttft_target_s:
                    missed[r.slo_class] = missed.get(r.slo_class, 0) + 1
            preemptions, refused = preemptions + fleet.preemptions, refused + len(fleet.refused)
            matched += router.matched_chars
        pt = report.point(self.w.rate, outcomes(done), round(preemptions / draws))
        for c in pt["per_class"].values():
            c["n"] //= draws
            c["goodput_rps"] = self.w.rate * c["n"] * draws / len(done) * c["attainment"]
        return pt | {"instances": n, "stopped_early": False, "refused": round(refused / draws),
                     "prefix_matched_chars": matched // draws}

    def _run(self, policy: str, n: int, seed: int, stop_early: bool, exact: ExactCosts | None,
             missed: dict[str, int] | None = None, draws: int = 1
             ) -> tuple[list[Request], Fleet, GatewayRouter] | dict[str, Any]:
        """One simulation of the fleet (`seed`: its draws of the noise): its requests, the fleet and its
        router, or, stopped early, what `evaluate` returns then. `missed`: by class, the misses of the
        earlier of `draws` pooled draws, which count towards stopping early."""
        reqs = self.requests()
        # as late at the client as the gateway and HTTP make it; the deadline the scheduler works to moves
        # as much (the real worker's lacks the first token's way back, about a third of it: a few ms)
        for r in reqs if self.outside_s else ():
            r.ttft_target_s -= self.outside_s
            r.deadline -= self.outside_s
        # where the gateway's polls fall against the trace (GatewayRouter): each draw its own share of the interval
        first_poll_s = (seed % draws + 0.5) / draws * self.poll_s
        router = GatewayRouter(n, self.key_of, self.poll_s, urls=self.urls(n) if self.urls else None,
                               first_poll_s=first_poll_s)
        # the noise around the pilot's median speed per size: median one, not mean one
        error = PredictionError(noise=self.noise, noise_mean_one=False, drift=self.drift, drift_s=self.drift_s)
        cfg = replace(sim_config(self.engine_cfg, error=error, seed=seed), arrival_cpu_s=self.serving_s,
                      idle_wake_s=self.idle_wake_s)
        fleet = Fleet(reqs, n, policy, self.cost, cfg, router, exact=exact, sheddable=self.sheddable,
                      max_waiting=self.engine_cfg.max_waiting, prefix_block_tokens=self.prefix_blocks)
        self.sims += 1
        counts = {c: sum(r.slo_class == c for r in reqs) * draws for c in {r.slo_class for r in reqs}}
        missed = missed or {}

        def pooled(misses: dict[str, int]) -> dict[str, int]:
            return {c: missed.get(c, 0) + misses.get(c, 0) for c in counts}

        hopeless = self._hopeless(counts, self.target - STOP_BELOW)
        if fleet.run((lambda misses: hopeless(pooled(misses))) if stop_early else None):
            return reqs, fleet, router
        total = pooled(fleet.misses)
        at_most = {c: 1 - total[c] / k for c, k in counts.items()}
        overall = 1 - sum(total.values()) / sum(counts.values())
        return {"instances": n, "stopped_early": True, "attainment_at_most": overall,
                "per_class_at_most": dict(sorted(at_most.items()))}

    def _hopeless(self, counts: dict[str, int], floor: float) -> Callable[[dict[str, int]], bool]:
        total = sum(counts.values())
        if self.every_class:
            return lambda misses: any(m > (1 - floor) * counts[c] for c, m in misses.items())
        return lambda misses: sum(misses.values()) > (1 - floor) * total

    def meets(self, pt: dict[str, Any]) -> bool:
        if pt["stopped_early"]:
            return False
        if self.every_class:
            return min(c["attainment"] for c in pt["per_class"].values()) >= self.target
        return bool(pt["attainment"] >= self.target)


def with_prefixes(w: Workload, reqs: list[Request]) -> list[Request]:
    """The trace's prompt blocks (Mooncake's hash ids) as the requests' block hashes."""
    for r, tr in zip(reqs, w.requests, strict=True):
        if tr.prefix:
            r.block_hashes = [h.to_bytes(8, "little", signed=True) for h in tr.prefix]
    return reqs


def smallest(meets: Callable[[int], bool], max_n: int) -> int | None:
    """The smallest n in [1, max_n] for which `meets(n)`, for a `meets` that stays true once true:
    doubling from 1 to the first n that meets it, then bisection below it. None: not even max_n."""
    lo, hi = 0, 1  # lo: known to fail (no instance serves nothing)
    while not meets(hi):
        if hi >= max_n:
            return None
        lo, hi = hi, min(2 * hi, max_n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def plan_policy(planner: Planner, policy: str, max_n: int, on_point: Callable[[int], None]) -> dict[str, Any]:
    """The smallest fleet for one policy, with every fleet size simulated on the way."""
    points: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        on_point(n)
        points[n] = planner.evaluate(policy, n)
        return planner.meets(points[n])

    n = smallest(meets, max_n)
    return {"instances": n, "at_instances": points.get(n) if n else None,
            "points": [points[k] for k in sorted(points)]}
