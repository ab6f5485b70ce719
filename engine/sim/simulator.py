"""Discrete-event simulation of one prefill instance.

The real `Scheduler` and policy objects run unmodified on a virtual clock; batches are real
`PrefillBatch`es with real step plans, whose steps take the time a cost model says instead of
running a model. Events (arrivals, completions) happen at their virtual times; a running step
always finishes before a switch, as on the real engine, unless `ideal` is set (preemption with
zero stop latency: the bound that perfect preemption could reach).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from engine.kv_cache import BlockPool
from engine.model.plan import OpCost, SeqSpan, plan_prefill
from engine.prefill import PrefillBatch
from engine.request import Request, RequestState
from engine.scheduler import Policy, Scheduler
from engine.sim.oracle import ExactCosts, OracleScheduler


@dataclass
class SimConfig:
    step_budget_s: float | None = 0.002  # None: one step per operator (checkpoints off)
    max_batch_tokens: int = 2048
    kv_capacity_tokens: int = 1 << 20
    kv_block_size: int = 256
    ideal: bool = False  # zero stop latency
    noise: float = 0.0  # lognormal sigma of true step durations around the cost model
    seed: int = 0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class VirtualRun:
    """Stands in for the model's forward: each next() is one step, taking no real time."""

    def __init__(self, n_steps: int) -> None:
        self.n, self.i = n_steps, 0

    def __iter__(self) -> VirtualRun:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration(None)
        self.i += 1
        return self.i - 1

    def seek(self, step: int) -> None:
        self.i = step

    def close(self) -> None:
        pass


def simulate(requests: list[Request], policy: Policy, cost: OpCost, cfg: SimConfig | None = None,
             true_cost: OpCost | None = None, exact: ExactCosts | None = None) -> int:
    """Run `requests` (arrival_time and deadline set, in seconds of virtual time) to their first
    token; fills in their timings like the engine does. Returns the number of preemptions.
    `true_cost`: what steps really take when it differs from the scheduler's `cost` model;
    `exact`: measured per-request costs that both predict and time every batch (the bound)."""
    cfg = cfg or SimConfig()
    true_cost = true_cost or cost
    rng = random.Random(cfg.seed)
    clock = _Clock()
    pool = BlockPool(cfg.kv_block_size, cfg.kv_capacity_tokens)

    def make_batch(reqs: list[Request], spans: list[SeqSpan]) -> PrefillBatch:
        for r in reqs:
            if not r.block_table:
                r.block_table = pool.allocate(r.max_total_tokens)
        steps = plan_prefill(sched.cost_for(reqs), spans, cfg.step_budget_s, last_token_only=True)
        return PrefillBatch(reqs, spans, steps, VirtualRun(len(steps)))  # type: ignore[arg-type]

    if exact is None:
        sched = Scheduler(policy, make_batch, cost, pool, cfg.max_batch_tokens, clock)
    else:
        sched = OracleScheduler(policy, make_batch, exact.base, pool, cfg.max_batch_tokens, clock)
        sched.exact = exact
    arrivals = deque(sorted(requests, key=lambda r: r.arrival_time))
    current: PrefillBatch | None = None
    step_left: dict[int, float] = {}  # batch id -> seconds left of its current step
    preemptions = 0

    def step_duration(batch: PrefillBatch) -> float:
        if batch.next_step >= len(batch.steps):
            return 0.0  # the final next() only returns (logits cost nothing here)
        i = batch.next_step
        d = batch.steps.cost(i) if true_cost is cost else true_cost.step_s(batch.steps[i])
        return d * rng.lognormvariate(0, cfg.noise) if cfg.noise else d

    while True:
        batch = sched.chosen
        if batch is None:
            if not arrivals:
                break
            r = arrivals.popleft()
            clock.t = max(clock.t, r.arrival_time)
            sched.on_arrival(r)
            continue
        if batch is not current:
            if current is not None and current in sched.pool:
                current.suspend(clock.t, sched.chosen_at, batch)
                preemptions += 1
            batch.begin_segment(clock.t)
            current = batch
        left = step_left.pop(batch.batch_id, None)
        if left is None and true_cost is cost and not cfg.ideal:
            _fast_forward(batch, clock, arrivals[0].arrival_time if arrivals else float("inf"), rng, cfg.noise)
        end = clock.t + (step_duration(batch) if left is None else left)
        if cfg.ideal and arrivals and arrivals[0].arrival_time < end:
            r = arrivals.popleft()  # ideal preemption: the step stops mid-way, its progress kept
            step_left[batch.batch_id] = end - r.arrival_time
            clock.t = r.arrival_time
            sched.on_arrival(r)
            continue
        while arrivals and arrivals[0].arrival_time <= end:  # events during a step are decided at
            r = arrivals.popleft()  # their own time and acted on at the next boundary
            clock.t = r.arrival_time
            sched.on_arrival(r)
        clock.t = end
        if batch.advance():
            _complete(batch, clock.t, pool, sched)
            current = None
    return preemptions


def _fast_forward(batch: PrefillBatch, clock: _Clock, until: float, rng: random.Random, noise: float) -> None:
    """Jump over the steps that end before the next event: nothing can happen at their boundaries
    (only an event changes the scheduler's choice), so stepping through them one by one is waste."""
    plan, i = batch.steps, batch.next_step
    if i >= len(plan):
        return
    factor = rng.lognormvariate(0, noise) if noise else 1.0
    base = plan.cost_before(i)
    j = min(len(plan), plan.first_step_ending_after(base + (until - clock.t) / factor))
    if j > i:
        clock.t += (plan.cost_before(j) - base) * factor
        batch.skip_to(j)


def _complete(batch: PrefillBatch, now: float, pool: BlockPool, sched: Scheduler) -> None:
    batch.end_segment(now)
    unfinished = []
    for r, span, whole in zip(batch.requests, batch.spans, batch.completes_prefills, strict=True):
        r.num_computed_tokens = span.start + span.length
        if whole:
            r.first_token_time = r.finish_time = now
            r.state = RequestState.FINISHED
            r.finish_reason = "length"
            pool.free(r.block_table)
        else:
            r.state = RequestState.WAITING
            unfinished.append(r)
    sched.on_completion(batch, unfinished)
