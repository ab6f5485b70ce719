"""Event-driven prefill scheduling (the paper's second idea).

The scheduler runs only on events: a request arrives, a batch completes, a request is cancelled.
Each event asks the policy for the batch that should run now and publishes it as `chosen`. The
engine loop compares `chosen` with the batch it is executing at every operator boundary (an O(1)
identity check) and switches when they differ: that is a preemption.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from engine.config import POLICIES, parse_policy  # noqa: F401 (the names, also read from here)
from engine.kv_cache import BlockPool
from engine.model.plan import OpCost, SeqSpan
from engine.prefill import PrefillBatch
from engine.request import Request

# A new batch is given as requests (each prefills the rest of its prompt) or as
# (request, tokens) chunks; an existing batch (running or suspended) is given as itself.
Chunk = tuple[Request, int]
Choice = PrefillBatch | list[Request] | list[Chunk] | None


class Policy(Protocol):
    name: str

    def choose(self, s: Scheduler) -> Choice:
        """The batch to run now: an existing one (running or suspended), new requests to batch, or None."""
        ...


class Scheduler:
    def __init__(self, policy: Policy, make_batch: Callable[[list[Request], list[SeqSpan]], PrefillBatch],
                 cost: OpCost, kv: BlockPool, max_batch_tokens: int,
                 clock: Callable[[], float] = time.monotonic,
                 reserve_tokens: Callable[[Request], int] = lambda r: r.max_total_tokens,
                 headroom_blocks: Callable[[], int] = lambda: 0) -> None:
        """`reserve_tokens`: the KV a request's batch takes when it forms (the engine's reservation
        policy); `headroom_blocks`: free blocks a new batch must leave (for the answers growing)."""
        self.policy, self.cost, self.kv = policy, cost, kv
        self.reserve_tokens, self.headroom_blocks = reserve_tokens, headroom_blocks
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
        req.predicted_miss = req.deadline - self.clock() - self.predict_s(req) < 0
        self.waiting.append(req)
        self._decide()

    def on_completion(self, batch: PrefillBatch, unfinished: Sequence[Request] = ()) -> None:
        """`unfinished`: requests of the batch with prompt left (chunks): they queue again."""
        self.pool.remove(batch)
        for r in unfinished:
            self.waiting.append(r)
        if unfinished:
            self.waiting.sort(key=lambda r: r.arrival_time)
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

    def on_evicted(self, req: Request) -> None:
        """An answer's KV was taken back while it decoded: it queues to be recomputed, in arrival
        order among the waiting (so first-come policies resume it first, as vLLM does)."""
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.arrival_time)
        self._decide()

    def on_kv_freed(self) -> None:
        """A request finished decoding or was cancelled: queued requests may now fit."""
        self._decide()

    # -- the decision --------------------------------------------------------------------------
    def _decide(self) -> None:
        self.invocations += 1
        self.now = self.clock()
        choice = self.policy.choose(self)
        if not choice and self.pool:
            # Work-conserving: a policy whose first pick waits for KV blocks picks nothing, yet a formed
            # batch holds blocks, which, left idle, it would hold for good when no answer is decoding
            # to free others. The most urgent formed batch runs until blocks come back.
            choice = self.chosen if self.chosen in self.pool else min(
                self.pool, key=lambda b: min(r.deadline for r in b.requests))
        if isinstance(choice, list):
            chunks = [c if isinstance(c, tuple) else (c, c.remaining_prefill_tokens) for c in choice]
            for r, _ in chunks:
                self.waiting.remove(r)
            choice = self._make_batch([r for r, _ in chunks],
                                      [SeqSpan(r.num_computed_tokens, n) for r, n in chunks])
            self.pool.append(choice)
        if choice is not self.chosen:
            self.chosen, self.chosen_at = choice, self.now

    # -- helpers for policies ------------------------------------------------------------------
    def cost_for(self, reqs: Sequence[Request]) -> OpCost:
        """The cost model that predicts these requests (the simulator's exact-cost oracle overrides it)."""
        return self.cost

    def predict_s(self, req: Request) -> float:
        """Predicted time to prefill the rest of a queued request's prompt."""
        return self.predict_batch_s([req])

    def predict_batch_s(self, reqs: Sequence[Request]) -> float:
        """Predicted time to prefill the rest of these requests' prompts as one batch."""
        spans = [SeqSpan(r.num_computed_tokens, r.remaining_prefill_tokens) for r in reqs]
        return self.cost_for(reqs).prefill_s(spans)

    def _blocks_needed(self, r: Request) -> int:
        # Whole: blocks of a cached prefix may be free ones, which taking them uses up.
        return max(0, self.kv.blocks_for(self.reserve_tokens(r)) - len(r.block_table))

    def _free_for_batch(self) -> int:
        return self.kv.num_free_blocks - self.headroom_blocks()

    def fill(self, ordered: list[Request], fits: Callable[[list[Request]], bool] | None = None) -> list[Request]:
        """Take whole requests in order while the token bound and KV capacity allow (the first
        always, KV permitting); `fits` can veto further additions. Once a request must wait for
        KV, no later one takes blocks before it; one that needs none (it holds its own) still runs."""
        batch: list[Request] = []
        tokens = blocks = 0
        free = self._free_for_batch()
        blocked = False
        for r in ordered:
            need = self._blocks_needed(r)
            if need and (blocked or blocks + need > free):
                blocked = True
                continue
            n = r.remaining_prefill_tokens
            if batch and (tokens + n > self.max_batch_tokens or (fits and not fits([*batch, r]))):
                break
            batch.append(r)
            tokens, blocks = tokens + n, blocks + need
        return batch

    def fill_chunks(self, ordered: list[Request], budget_tokens: int) -> list[Chunk]:
        """Fill a batch to exactly `budget_tokens` (or what is queued) with prompt chunks, in order."""
        chunks: list[Chunk] = []
        left, blocks = budget_tokens, 0
        free = self._free_for_batch()
        blocked = False
        for r in ordered:
            need = self._blocks_needed(r)
            if need and (blocked or blocks + need > free):  # as in `fill`: a prompt mid-way still runs
                blocked = True
                continue
            n = min(left, r.remaining_prefill_tokens)
            chunks.append((r, n))
            left, blocks = left - n, blocks + need
            if left == 0:
                break
        return chunks


def make_policy(name: str) -> Policy:
    """flowprefill | fcfs | chunked:N[:fcfs] | edf | priority (POLICIES; ValueError for another name)"""
    from engine.scheduler.chunked import Chunked
    from engine.scheduler.edf import EDF
    from engine.scheduler.fcfs import FCFS
    from engine.scheduler.flowprefill import FlowPrefill
    from engine.scheduler.priority import Priority

    kind, chunk_tokens, order = parse_policy(name)
    if kind == "chunked":
        return Chunked(chunk_tokens, order)
    policies: dict[str, Callable[[], Policy]] = {"fcfs": FCFS, "flowprefill": FlowPrefill, "edf": EDF,
                                                 "priority": Priority}
    return policies[kind]()
