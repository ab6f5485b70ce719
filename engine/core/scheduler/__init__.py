"""Event-driven prefill scheduling (the paper's second idea).

The scheduler runs only on events: a request arrives, a batch completes, a request is cancelled, or
the late tier's turn begins or ends (`wake_at`, see slack.py). Each event asks the policy for the
batch that should run now and publishes it as `chosen`. The engine loop compares `chosen` with the
batch it is executing at every operator boundary (an O(1) identity check, and one compare with
`wake_at`) and switches when they differ: that is a preemption.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from engine.core.config import POLICIES, parse_policy  # noqa: F401 (the names, also read from here)
from engine.core.kv_cache import BlockPool
from engine.core.owner import Owned, owned
from engine.core.prefill import PrefillBatch
from engine.core.request import Request, RequestState
from engine.core.scheduler.slack import SHARED, LateShare, judge, remaining_of, standings
from engine.model.cost import OpCost, PrefillTerms, SeqSpan

# A request is refused (shed) for a predicted miss on its own prediction alone. Where no batch of its
# size has run, that prediction is calibration alone, and calibration taken while another process shared
# the cores reads slow: 4x here (FFN 4.6e-5 s/row against 1.2e-5 on the quiet core, timed while vLLM
# started on the same core). Refused on it, every long request of a sheddable class would be refused for
# good (a refused request never runs, so nothing corrects the prediction). Unconfirmed, a request is
# refused only when it would miss even this much faster than predicted; once admitted, its run teaches
# the correction (OpCost.observe).
UNCONFIRMED_SPEEDUP = 4.0

# A new batch is given as requests (each prefills the rest of its prompt) or as
# (request, tokens) chunks; an existing batch (running or suspended) is given as itself.
Chunk = tuple[Request, int]
Choice = PrefillBatch | list[Request] | list[Chunk] | None


class Policy(Protocol):
    name: str

    def choose(self, s: Scheduler) -> Choice:
        """The batch to run now: an existing one (running or suspended), new requests to batch, or None."""
        ...


class _Predicted(NamedTuple):
    """A request's remembered prediction (`Scheduler.predict_s`): what it was made from, and the seconds."""

    cost: OpCost
    calibration: tuple[object, ...]
    terms: PrefillTerms
    correction: tuple[float, float]
    seconds: float


class Scheduler(Owned):
    def __init__(self, policy: Policy, make_batch: Callable[[list[Request], list[SeqSpan]], PrefillBatch],
                 cost: OpCost, kv: BlockPool, max_batch_tokens: int,
                 clock: Callable[[], float] = time.monotonic,
                 reserve_tokens: Callable[[Request], int] = lambda r: r.max_total_tokens,
                 headroom_blocks: Callable[[], int] = lambda: 0, late_share: float = 0.5) -> None:
        """`reserve_tokens`: the KV a request's batch takes when it forms (the engine's reservation
        policy); `headroom_blocks`: free blocks a new batch must leave (for the answers growing);
        `late_share`: the late tier's guaranteed share of the engine (slack.py)."""
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
        self.late = LateShare(late_share)
        self.wake_at = math.inf  # the next decision no event would make (the late tier's turn)
        self.shed: list[Request] = []  # late requests of `late = "shed"` classes, for the engine to end
        self._standing: dict[int, tuple[int, float]] = {}  # this decision's (standing, due), by id (slack.py)
        self._turns_at = math.inf
        self._predicted: dict[str, _Predicted] = {}  # predict_s's, by request id

    # -- events --------------------------------------------------------------------------------
    @owned
    def on_arrival(self, req: Request) -> None:
        req.predicted_miss = req.deadline - self.clock() - self.predict_s(req) < 0
        self.waiting.append(req)
        self._decide()

    @owned
    def on_completion(self, batch: PrefillBatch, unfinished: Sequence[Request] = ()) -> None:
        """`unfinished`: requests of the batch with prompt left (chunks): they queue again."""
        self.pool.remove(batch)
        for r in unfinished:
            self.waiting.append(r)
        if unfinished:
            self.waiting.sort(key=lambda r: r.arrival_time)
        self._decide()

    @owned
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

    @owned
    def on_evicted(self, req: Request) -> None:
        """An answer's KV was taken back while it decoded (`num_computed_tokens`: what of it is still
        cached): it queues to be recomputed, in arrival order among the waiting (so first-come policies
        resume it first, as vLLM does). Its next token is due a TBT target after its recompute, were it
        to run now: the deadline its slack is ranked by, so it starts feasible and grows urgent as it
        waits (a bare TBT target would rank a long recompute hopeless at once, behind every feasible
        prompt, for as long as they come)."""
        req.state = RequestState.WAITING
        req.deadline = self.clock() + self.predict_s(req) + req.tbt_target_s
        req.times.evictions += 1
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.arrival_time)
        self._decide()

    @owned
    def on_kv_freed(self) -> None:
        """A request finished decoding or was cancelled: queued requests may now fit."""
        self._decide()

    @owned
    def on_timer(self) -> None:
        """`wake_at` has come: the late tier's turn begins or ends."""
        self._decide()

    # How often the engine tells the cost model what the running batch measured (`on_progress`): a
    # 2 s prefill corrects its size class 40 times on its way, 25 steps of 2 ms each time.
    progress_every_s = 0.05

    @owned
    def on_progress(self, batch: PrefillBatch) -> None:
        """The batch ran more steps (every `progress_every_s` of measured time, and when it completes):
        the cost model's correction learns what they measured against what it predicted."""
        whole = batch.observed == (0.0, 0.0)  # nothing of it reported yet
        base_s, measured_s = batch.take_progress()
        self.cost.observe(batch.num_tokens, base_s, measured_s, whole)

    @owned
    def on_host_gap(self, seconds: float) -> None:
        """A batch began `seconds` after the device went idle with its work waiting (the host's time
        between batches): the cost model's host time per batch learns it."""
        self.cost.observe_host(seconds)

    # -- the decision --------------------------------------------------------------------------
    def _decide(self) -> None:
        self.invocations += 1
        self.now = self.clock()
        self.late.account(self.now)
        self._shed_late()
        self._standing, self._turns_at = (standings(self, [*self.pool, *self.waiting], self.late.share)
                                          if getattr(self.policy, "ranks_by_slack", False) else ({}, math.inf))
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
            if self._standing:
                self._standing[id(choice)] = self.judged(choice.head)  # it is its head's choice
            self.pool.append(choice)
        if choice is not self.chosen:
            self.chosen, self.chosen_at = choice, self.now
        self._turns()

    def _turns(self) -> None:
        """The late tier's accounting (slack.py), and when to decide again without an event: when its
        turn begins or ends, or when late work turns critical."""
        if not self._standing:
            self.wake_at = self.late.decided(self.now, False, False, False)
            return
        shared = [self.standing(item) in SHARED for item in [*self.pool, *self.waiting]]
        late_runs = self.chosen is not None and self.standing(self.chosen) in SHARED
        self.wake_at = min(self.late.decided(self.now, any(shared), not all(shared), late_runs), self._turns_at)

    def _shed_late(self) -> None:
        """Queued requests of `late = "shed"` classes that can no longer meet their deadline leave
        (the engine ends them; the worker answers 429). Work begun, or an answer begun, is kept."""
        for r in [r for r in self.waiting if r.shed_late and r.times.prefill_start is None and not r.output_token_ids]:
            # (negative slack, on a prediction strong enough to refuse on: cannot_meet implies slack < 0)
            if self.cannot_meet([r], self.predict_s(r), r.remaining_prefill_tokens, self.now):
                self.waiting.remove(r)
                self.shed.append(r)

    def standing(self, item: Request | PrefillBatch) -> int:
        """ON_TIME, LATE, CRITICAL, LOST or BRIEF_LOST (slack.py), as judged at this decision."""
        return self.judged(item)[0]

    def judged(self, item: Request | PrefillBatch) -> tuple[int, float]:
        """Its standing and when it is due (slack.py), as judged at this decision."""
        if (judged := self._standing.get(id(item))) is None:
            judged = self._standing[id(item)] = judge(self, item, remaining_of(self, item))
        return judged

    def backlog(self) -> tuple[float, dict[str, float]]:
        """The predicted prefill work queued here, as a worker's GET /load reports it for routing: what
        the formed batches (running and suspended) still owe, and the waiting requests' predictions by
        SLO class (the simulator's fleet routes on the same numbers). Both with the correction as it is
        now: a batch's own `remaining_s` is at its plan's, which after a 3x slowdown owes a third of it."""
        by_class: dict[str, float] = {}
        for r in self.waiting:
            by_class[r.slo_class] = by_class.get(r.slo_class, 0.0) + self.predict_s(r)
        return sum(self.remaining_s(b) for b in self.pool), by_class

    # -- helpers for policies ------------------------------------------------------------------
    def cost_for(self, reqs: Sequence[Request]) -> OpCost:
        """The cost model that predicts these requests (the simulator's exact-cost oracle overrides it)."""
        return self.cost

    def remaining_s(self, batch: PrefillBatch) -> float:
        """Predicted time to finish a formed batch from where it stands, with the correction as it is
        now (not as it was when the batch was planned: a batch suspended before a slowdown owes more).
        A finished batch, whose first tokens are going out, owes nothing."""
        if batch.finished:
            return 0.0
        cost = self.cost_for(batch.requests)
        return batch.remaining_base_s * cost.scale * cost.factor(batch.num_tokens) + cost.batch_host_s

    def cannot_meet(self, reqs: Sequence[Request], predicted_s: float, tokens: int, now: float) -> bool:
        """Whether requests predicted to take `predicted_s` (alone, `tokens` prompt tokens to compute, at
        the speed the cost model observes now) could not be served even by the first one's `latest`
        (its class's late bound, or its deadline where late requests are shed), on a prediction strong
        enough to refuse them on (UNCONFIRMED_SPEEDUP). A request that is only late is served late, as
        the late tier promises, not refused."""
        if not self.cost_for(reqs).confirmed(tokens):
            predicted_s /= UNCONFIRMED_SPEEDUP
        return reqs[0].latest - now - predicted_s < 0

    def predict_s(self, req: Request) -> float:
        """Predicted time to prefill the rest of a queued request's prompt. A decision judges every waiting
        request: predicting each anew took 18 of the 27 us a decision spent per waiting request (3.2 ms with
        375 waiting on an EPYC core; the engine serves none meanwhile). So the prediction is remembered
        until its prompt left or the cost model moves, and so are its calibrated terms until its prompt
        left or the calibration moves: the correction moves at every finished batch, and remaking the
        terms with it took 1.2 of a 2.5 ms host gap with 300 waiting (tiny model)."""
        cost = self.cost_for([req])
        span = SeqSpan(req.num_computed_tokens, req.remaining_prefill_tokens)
        calibration = (span, cost.terms_key())
        correction = (cost.factor(span.length), cost.batch_host_s)
        known = self._predicted.get(req.request_id)
        terms = None
        if known is not None and known.cost is cost and known.calibration == calibration:
            if known.correction == correction:
                return known.seconds
            terms = known.terms
        if len(self._predicted) > 2 * (len(self.waiting) + len(self.pool)) + 64:
            self._predicted.clear()  # requests long gone (bounded without tracking how each left)
        terms = terms or cost.prefill_terms([span])
        seconds = self.predict_batch_s([req], terms)
        # (the cost model is held: `is` stays sound)
        self._predicted[req.request_id] = _Predicted(cost, calibration, terms, correction, seconds)
        return seconds

    def predict_batch_s(self, reqs: Sequence[Request], terms: PrefillTerms | None = None) -> float:
        """Predicted time to prefill the rest of these requests' prompts as one batch, to its first
        tokens (the host's time per batch included). `terms`: their `prefill_terms`, if known."""
        spans = [SeqSpan(r.num_computed_tokens, r.remaining_prefill_tokens) for r in reqs]
        cost = self.cost_for(reqs)
        return cost.prefill_s(spans, terms) + cost.batch_host_s

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
    from engine.core.scheduler.chunked import Chunked
    from engine.core.scheduler.edf import EDF
    from engine.core.scheduler.fcfs import FCFS
    from engine.core.scheduler.flowprefill import FlowPrefill
    from engine.core.scheduler.priority import Priority

    kind, chunk_tokens, order = parse_policy(name)
    if kind == "chunked":
        return Chunked(chunk_tokens, order)
    policies: dict[str, Callable[[], Policy]] = {"fcfs": FCFS, "flowprefill": FlowPrefill, "edf": EDF,
                                                 "priority": Priority}
    return policies[kind]()
