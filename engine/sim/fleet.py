"""Several simulated instances behind a router, on one virtual clock.

Each instance is a `Simulation` (engine/sim/simulator.py): the real scheduler and policy, stepped by the
same code as a lone instance. A global event loop takes, in time order, the next arrival (which the
router sends to an instance at its arrival time, from what the instances' loads were at the router's
last poll), the router's polls, and each instance's own events (a step begins or ends, its scheduler's
wake-up), so that every routing decision sees every instance as it stands at that moment. Ties go as a
lone instance takes them (a step begins before an arrival at the same time, an arrival before a
wake-up, both before a step's end): one instance behind a trivial router is `simulate` exactly.

The router is an interface (`Router`) so that this core module needs nothing of the gateway: the
planner (engine/planner/) passes an adapter around the gateway's own `WorkerPool`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from engine.core.request import Request, RequestState
from engine.core.scheduler import make_policy
from engine.model.cost import OpCost
from engine.sim.oracle import ExactCosts
from engine.sim.simulator import BatchRecord, SimConfig, Simulation

Load = tuple[float, dict[str, float]]  # what an instance's GET /load says: formed batches' s, waiting s by class
# The instances' noise streams are independent; instance 0 keeps the seed, as a lone instance does.
SEED_STRIDE = 7919
BEGIN, ARRIVAL, TIMER, END = range(4)  # the order of events due at the same time


class Router(Protocol):
    """Where each request goes. `pick` counts it in flight at the instance it names; `shed` (the
    instance refused it at admission: the router may pick another) and `finished` (its first token is
    out) take it back; `admitted` tells where it runs (prefix affinity's record)."""

    def pick(self, req: Request, now: float, tried: set[int]) -> int | None: ...

    def shed(self, req: Request, instance: int) -> None: ...

    def admitted(self, req: Request, instance: int) -> None: ...

    def finished(self, req: Request, instance: int) -> None: ...

    def reported(self, instance: int, load: Load) -> None:
        """The instance's load once it admitted a request, as its answer reports it."""
        ...

    def poll_at(self) -> float:
        """When the router next reads the instances' loads (inf: never)."""
        ...

    def poll(self, now: float, loads: Sequence[Load]) -> None: ...


class Fleet:
    """`n` instances of `policy`, each with its own scheduler, KV pool and noise stream, fed
    `requests` through `router`. Admission as a worker's: a request of a `sheddable` class that
    could not meet its deadline even if it ran next, or any request past `max_waiting` queued, is
    refused there, and the router may try another instance (the gateway's retry of a shed request);
    refused everywhere, it fails. `prefix_block_tokens`: the requests' `block_hashes` name blocks of
    this many tokens (the instances' KV block size then), and each instance caches them as the engine
    does (engine/core/prefix_cache.py: a request computes only what is cached where it runs when its
    batch forms); None: no prefix caching."""

    def __init__(self, requests: list[Request], n: int, policy: str, cost: OpCost, cfg: SimConfig, router: Router,
                 exact: ExactCosts | None = None, sheddable: frozenset[str] = frozenset(),
                 max_waiting: int | None = None, prefix_block_tokens: int | None = None) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one instance")
        self.arrivals = deque(sorted(requests, key=lambda r: r.arrival_time))
        span = (self.arrivals[0].arrival_time, self.arrivals[-1].arrival_time) if requests else (0.0, 0.0)
        if prefix_block_tokens:  # the instances' KV blocks are the trace's: its hashes name them
            cfg = replace(cfg, prefix_caching=True, kv_block_size=prefix_block_tokens)
        self.sims = [Simulation([], make_policy(policy), cost, replace(cfg, seed=cfg.seed + SEED_STRIDE * i), exact,
                                span) for i in range(n)]
        self.router, self.sheddable, self.max_waiting = router, sheddable, max_waiting
        self.refused: list[Request] = []  # shed by every instance tried
        self.placed: dict[str, int] = {}  # request id -> the instance that admitted it
        self._shed_seen = [0] * n  # late requests each scheduler shed while queued, taken back so far
        self.misses: dict[str, int] = {}  # certain misses so far, by class (`run`'s `hopeless`)
        self._by_deadline = sorted(requests, key=lambda r: r.deadline)
        self._overdue = 0  # of `_by_deadline`: the ones whose deadline has passed and were counted

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.sims)

    @property
    def batches(self) -> list[BatchRecord]:
        return [b for s in self.sims for b in s.batches]

    def load(self, i: int) -> Load:
        return self.sims[i].sched.backlog()

    def run(self, hopeless: Callable[[dict[str, int]], bool] | None = None) -> bool:
        """Run every request to its first token (or its refusal). `hopeless`: asked at each arrival
        with the certain misses so far by class (requests past their deadline without a first token in
        time); True stops the run there. Returns False when it stopped so."""
        while True:
            t_arr = self.arrivals[0].arrival_time if self.arrivals else math.inf
            t, kind, i = min(((*self._next(s), i) for i, s in enumerate(self.sims)), default=(math.inf, END, 0))
            if t_arr == math.inf and t == math.inf:
                break
            t_poll = self.router.poll_at()
            if t_poll <= min(t, t_arr):
                self.router.poll(t_poll, [self.load(j) for j in range(len(self.sims))])
            elif (t, kind) < (t_arr, ARRIVAL):
                self._act(i, t, kind, t_arr)
            else:
                if hopeless is not None and hopeless(self._count_misses(t_arr)):
                    return False
                self._dispatch(self.arrivals.popleft(), t_arr)
        for s in self.sims:
            s.finish()
        return True

    def _next(self, s: Simulation) -> tuple[float, int]:
        """An instance's next own event: a step to begin now, its wake-up during a step, the step's end.
        Idle, it waits for an arrival (as a lone instance, it takes no wake-up then)."""
        if s.step_end is None:
            return (s.clock.t, BEGIN) if s.has_work() else (math.inf, END)
        return (s.sched.wake_at, TIMER) if s.sched.wake_at <= s.step_end else (s.step_end, END)

    def _act(self, i: int, t: float, kind: int, t_arr: float) -> None:
        s = self.sims[i]
        if kind == BEGIN:
            s.lookahead = t_arr  # a fast-forward stops where the next arrival may come here
            s.begin_step()
            return
        if kind == TIMER:
            if s.cfg.ideal and not s.decoding and t < s.step_end:  # type: ignore[operator]
                s.cut(t)
            s.fire(t)
        else:
            s.end_step()
        for r in s.done:
            self.router.finished(r, i)
        s.done.clear()
        for r in s.sched.shed[self._shed_seen[i]:]:  # ended by the engine there: no longer in flight
            self.router.finished(r, i)
        self._shed_seen[i] = len(s.sched.shed)

    def _dispatch(self, req: Request, t: float) -> None:
        tried: set[int] = set()
        while (i := self.router.pick(req, t, tried)) is not None:
            tried.add(i)
            s = self.sims[i]
            req.num_computed_tokens = req.cached_tokens = s.cached_tokens(req)  # what admission sees
            if self._refuses(s, req, t):
                self.router.shed(req, i)
                continue
            self.router.admitted(req, i)
            self.placed[req.request_id] = i
            if s.cfg.ideal and not s.decoding and s.step_end is not None and t < s.step_end:
                s.cut(t)  # ideal preemption: the running step stops at the arrival
            s.arrive(req, t)
            self.router.reported(i, self.load(i))
            return
        req.state, req.finish_reason = RequestState.FAILED, "shed"
        self.refused.append(req)

    def _refuses(self, s: Simulation, req: Request, t: float) -> bool:
        """A worker's admission (engine/core/engine.py, `Engine.admission`)."""
        sched = s.sched
        if self.max_waiting is not None and (
                len(sched.waiting) + sum(len(b.requests) for b in sched.pool) + 1 > self.max_waiting):
            return True
        return req.slo_class in self.sheddable and sched.cannot_meet([req], sched.predict_s(req),
                                                                      req.remaining_prefill_tokens, t)

    def _count_misses(self, now: float) -> dict[str, int]:
        """Each request whose deadline is past now counts once, if its first token was not out by then."""
        reqs = self._by_deadline
        while self._overdue < len(reqs) and reqs[self._overdue].deadline < now:
            r = reqs[self._overdue]
            if r.times.first_token_time is None or r.times.first_token_time > r.deadline:
                self.misses[r.slo_class] = self.misses.get(r.slo_class, 0) + 1
            self._overdue += 1
        return self.misses

