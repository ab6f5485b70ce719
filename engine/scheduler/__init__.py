"""Event-driven prefill scheduling (the paper's second idea).

The scheduler runs only on events: a request arrives, a batch completes, a request is cancelled.
Each event asks the policy for the batch that should run now and publishes it as `chosen`. The
engine loop compares `chosen` with the batch it is executing at every operator boundary (an O(1)
identity check) and switches when they differ: that is a preemption.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from engine.kv_cache import KVCache
from engine.model.plan import OpCost, SeqSpan
from engine.prefill import PrefillBatch
from engine.request import Request

Choice = PrefillBatch | list[Request] | None


class Policy(Protocol):
    name: str

    def choose(self, s: Scheduler) -> Choice:
        """The batch to run now: an existing one (running or suspended), new requests to batch, or None."""
        ...


class Scheduler:
    def __init__(self, policy: Policy, make_batch: Callable[[list[Request]], PrefillBatch], cost: OpCost,
                 kv: KVCache, max_batch_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.cost, self.kv = policy, cost, kv
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self._make_batch = make_batch
        self.waiting: list[Request] = []  # arrival order
        self.pool: list[PrefillBatch] = []  # started or formed batches, not yet finished
        self.chosen: PrefillBatch | None = None
        self.chosen_at = 0.0
        self.now = 0.0
        self.invocations = 0

    # -- events --------------------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        self.waiting.append(req)
        self._decide()

    def on_completion(self, batch: PrefillBatch) -> None:
        self.pool.remove(batch)
        self._decide()

    def on_cancel(self, req: Request) -> PrefillBatch | None:
        """Returns the batch to drop when every request in it is now cancelled."""
        dropped = None
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            batch = next((b for b in self.pool if req in b.requests), None)
            if batch and all(r.state.done or r is req for r in batch.requests):
                self.pool.remove(batch)
                dropped = batch
        self._decide()
        return dropped

    # -- the decision --------------------------------------------------------------------------
    def _decide(self) -> None:
        self.invocations += 1
        self.now = self.clock()
        choice = self.policy.choose(self)
        if isinstance(choice, list):
            for r in choice:
                self.waiting.remove(r)
            choice = self._make_batch(choice)
            self.pool.append(choice)
        if choice is not self.chosen:
            self.chosen, self.chosen_at = choice, self.now

    # -- helpers for policies ------------------------------------------------------------------
    def predict_s(self, req: Request) -> float:
        return self.cost.prefill_s([SeqSpan(0, req.num_prompt_tokens)])

    def fill(self, ordered: list[Request], fits: Callable[[list[Request]], bool] | None = None) -> list[Request]:
        """Take requests in order while the token bound and KV capacity allow (the first always,
        KV permitting); `fits` can veto further additions."""
        batch: list[Request] = []
        tokens = blocks = 0
        for r in ordered:
            need = self.kv.blocks_for(r.max_total_tokens)
            if blocks + need > self.kv.num_free_blocks:
                break
            if batch and (tokens + r.num_prompt_tokens > self.max_batch_tokens or (fits and not fits([*batch, r]))):
                break
            batch.append(r)
            tokens += r.num_prompt_tokens
            blocks += need
        return batch


def make_policy(name: str) -> Policy:
    from engine.scheduler.fcfs import FCFS
    from engine.scheduler.flowprefill import FlowPrefill

    policies: dict[str, Callable[[], Policy]] = {"fcfs": FCFS, "flowprefill": FlowPrefill}
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}: choose from {sorted(policies)}")
    return policies[name]()
