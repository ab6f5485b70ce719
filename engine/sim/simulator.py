"""Discrete-event simulation of one prefill instance.

The real `Scheduler` and policy objects run unmodified on a virtual clock, stepped by the engine's own
loop (engine/core/prefill.py: switches, preemptions, progress reports, completions); batches are
real `PrefillBatch`es with real step plans, whose steps take the time a cost model says instead of
running a model (a virtual device: this module is its clock and event driver). Events (arrivals, the
scheduler's own wake-ups) happen at their virtual times; a running step always finishes before a
switch, as on the real engine, unless `ideal` is set (preemption with zero stop latency: the bound
that perfect preemption could reach).

The truth is the cost model as given, frozen, times the injected prediction error
(`SimConfig.error`, engine/sim/errors.py); the scheduler predicts with its own copy, which learns
online from the true times of the steps it ran and the host gaps before its batches, as the engine's
does (`Scheduler.on_progress`, `on_host_gap`).
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.decode import Answers
from engine.core.kv_cache import BlockPool, reserved_tokens
from engine.core.prefill import PrefillBatch, PrefillLoop
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request, RequestState, Sampled
from engine.core.scheduler import Policy, Scheduler
from engine.core.tokenizer import ByteTokenizer
from engine.model.cost import OpCost, SeqSpan
from engine.model.plan import plan_prefill
from engine.sim.errors import PredictionError
from engine.sim.oracle import ExactCosts, OracleScheduler


@dataclass
class SimConfig:
    step_budget_s: float | None = 0.002  # None: one step per operator (checkpoints off)
    max_batch_tokens: int = 2048
    kv_capacity_tokens: int = 1 << 20
    kv_block_size: int = 256
    kv_reservation: str = "grow"  # the engine's (EngineConfig.kv_reservation)
    # The engine's prefix cache, on the requests' `block_hashes` (a trace's, one per KV block); a request
    # without them shares nothing (simulated prompts are placeholders: their tokens say nothing)
    prefix_caching: bool = False
    ideal: bool = False  # zero stop latency
    noise: float = 0.0  # lognormal sigma of true step durations around the cost model
    seed: int = 0
    error: PredictionError = field(default_factory=PredictionError)  # true costs against predictions
    late_share: float = 0.5  # the scheduler's (EngineConfig.late_share)
    # CPU a request's arrival costs the instance's own core (a CPU worker's HTTP side beside its engine
    # loop): a step running when it arrives ends this much later (engine/planner/measured.py's net_of_serving)
    arrival_cpu_s: float = 0.0
    # What a batch begun on an idle instance takes beyond its size's speed: a CPU worker's thread waking
    # from its wait, its caches cold (engine/planner/measured.py's idle_wake)
    idle_wake_s: float = 0.0


# What the virtual device samples: a byte, never an end of sequence, so an answer runs to its max_tokens.
TOKEN = Sampled(ord("a"))


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class VirtualRun:
    """Stands in for the model's forward: each next() runs one step (or, after `seek`, every step up to
    the one sought at once), taking no real time; the simulator charges their time."""

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
        """The next next() runs the steps up to `step` and yields it."""
        self.i = step

    def close(self) -> None:
        pass


def simulate(requests: list[Request], policy: Policy, cost: OpCost, cfg: SimConfig | None = None,
             exact: ExactCosts | None = None, batches: list[BatchRecord] | None = None) -> int:
    """Run `requests` (arrival_time and deadline set, in seconds of virtual time) to their first
    token; fills in their timings like the engine does. Returns the number of preemptions.
    `cost` is left as given; `exact`: measured per-request costs that both predict and time every
    batch (the bound; no prediction error, no online correction); `batches`: a list that gets a
    record of every completed batch (the correction's error, batch by batch)."""
    sim = Simulation(requests, policy, cost, cfg or SimConfig(), exact)
    if batches is not None:
        sim.batches = batches
    return sim.run()


class BatchRecord(NamedTuple):
    """A completed batch: when it began, its prompt tokens, the time predicted for it when it formed
    (the correction as it was then) and the time it took."""

    start: float
    tokens: int
    predicted_s: float
    measured_s: float


class Simulation:
    """One instance. `requests`: its own arrivals (none for a fleet's instance, whose router sends
    them with `arrive`); `span`: the first and last arrival of the whole run (the machine's slowdown
    step is placed in it), by default those of `requests`."""

    def __init__(self, requests: list[Request], policy: Policy, cost: OpCost, cfg: SimConfig,
                 exact: ExactCosts | None, span: tuple[float, float] | None = None) -> None:
        self.cfg, self.exact = cfg, exact
        self.rng = random.Random(cfg.seed)
        self.clock = _Clock()
        self.kv = BlockPool(cfg.kv_block_size, cfg.kv_capacity_tokens)
        self.arrivals = deque(sorted(requests, key=lambda r: r.arrival_time))
        if span is None:
            span = (self.arrivals[0].arrival_time, self.arrivals[-1].arrival_time) if requests else (0.0, 0.0)
        first, last = span
        self.machine = cfg.error.machine(last - first, cfg.seed + 1, start_s=first)
        self.truth = copy.deepcopy(cost)  # what the machine does (times the error); never learns
        self.own_factor: dict[int, float] = {}  # batch id -> its own draw of the noise (exact: true s per planned s)
        if exact is None:
            model = copy.deepcopy(cost)  # the scheduler's: biased as asked, it learns from what steps take
            model.scale *= cfg.error.bias
            self.sched = Scheduler(policy, self._make_batch, model, self.kv, cfg.max_batch_tokens,
                                   self.clock, self._reserve_tokens, self._headroom_blocks, cfg.late_share)
        else:
            self.sched = OracleScheduler(policy, self._make_batch, exact.base, self.kv, cfg.max_batch_tokens,
                                         self.clock, self._reserve_tokens, self._headroom_blocks, cfg.late_share)
            self.sched.exact = exact
        self.loop = PrefillLoop(self.sched, self.clock)
        self.answers = Answers(self.kv, ByteTokenizer())  # the engine's: decode's pace, KV growth, evictions
        self.prefixes = PrefixCache(self.kv, cfg.prefix_caching)
        self.decoding = False  # the running step is a decode step
        self.runs: dict[int, VirtualRun] = {}  # batch id -> its virtual forward
        self.batches: list[BatchRecord] = []
        self.step_left: dict[int, float] = {}  # ideal: batch id -> seconds left of its cut step
        self.step_start: float = 0.0
        self.step_end: float | None = None  # the running step's (step_end None: no step running)
        self.busy_until = -math.inf  # when its last step ended (a batch begun later begins idle)
        self.lookahead = math.inf  # a fleet's next arrival: a fast-forward stops there too
        self.done: list[Request] = []  # first tokens out since the caller last emptied it (a fleet's router reads it)

    def _make_batch(self, reqs: list[Request], spans: list[SeqSpan]) -> PrefillBatch:
        spans = [self.prefixes.take(r, span) for r, span in zip(reqs, spans, strict=True)]
        for r in reqs:
            self.kv.reserve(r.block_table, self._reserve_tokens(r))
        planner = self.sched.cost_for(reqs) if self.exact is None else self.exact.plan_cost(reqs)
        steps = plan_prefill(planner, spans, self.cfg.step_budget_s, last_token_only=True)
        run = VirtualRun(len(steps))
        batch = PrefillBatch(reqs, spans, steps, run, timer=self.clock)  # type: ignore[arg-type]
        self.runs[batch.batch_id] = run
        if self.exact is None:
            self.own_factor[batch.batch_id] = self.machine.batch_factor()
        else:  # true seconds per planned second: the measured factor over the plan's own scale
            self.own_factor[batch.batch_id] = self.exact.for_requests(reqs).scale / steps.scale
        return batch

    def _reserve_tokens(self, req: Request) -> int:
        return reserved_tokens(req, self.cfg.kv_reservation)

    def _headroom_blocks(self) -> int:
        """As the engine's (`Engine._headroom_blocks`): a block per growing answer stays free."""
        return len(self.answers.running) if self.cfg.kv_reservation == "grow" else 0

    @property
    def preemptions(self) -> int:
        return self.loop.preemptions

    def true_rate(self, batch: PrefillBatch) -> float:
        """True seconds per second of the batch's plan, now."""
        if self.exact is not None:
            return self.own_factor[batch.batch_id]  # the measured costs, whatever the plan's scale
        truth = self.truth.scale * self.truth.factor(batch.num_tokens)
        return truth * self.machine.at(self.clock.t) * self.own_factor[batch.batch_id] / batch.steps.scale

    def next_event(self) -> float:
        """When this instance's next own event is due: its next arrival or its scheduler's wake-up."""
        return min(self.arrivals[0].arrival_time if self.arrivals else math.inf, self.sched.wake_at)

    def fire(self, t: float) -> None:
        """The event due at t: the next arrival, or the scheduler's wake-up."""
        if self.arrivals and self.arrivals[0].arrival_time <= t:
            self.arrive(self.arrivals.popleft(), t)
        else:
            self.clock.t = max(self.clock.t, t)
            self.sched.on_timer()

    def arrive(self, req: Request, t: float) -> None:
        """`req` arrives here at t (its own arrival, or a fleet's router sending it here); a step running
        then ends `arrival_cpu_s` later."""
        self.clock.t = max(self.clock.t, t)
        if self.cfg.arrival_cpu_s and self.step_end is not None and t < self.step_end and not self.cfg.ideal:
            self.step_end += self.cfg.arrival_cpu_s
        if self.cfg.prefix_caching:  # looked up as the engine queues it (engine/core/engine.py's _queue)
            req.num_computed_tokens = req.cached_tokens = self.cached_tokens(req)
        self.sched.on_arrival(req)

    def cached_tokens(self, req: Request) -> int:
        """What of its prompt is cached here (the engine's lookup). A request without block hashes shares
        nothing: a simulated prompt's tokens are placeholders, alike in every prompt of a length."""
        return self.prefixes.cached_tokens(req) if req.block_hashes is not None else 0

    def has_work(self) -> bool:
        """A prefill batch chosen or answers decoding: the device runs a step."""
        return self.sched.chosen is not None or bool(self.answers.running)

    def run(self) -> int:
        while self.has_work() or self.arrivals:
            if not self.has_work():
                self.fire(self.arrivals[0].arrival_time)
                continue
            end = self.begin_step()
            if end is None:
                continue
            if self.cfg.ideal and not self.decoding and self.next_event() < end:
                t = self.next_event()  # ideal preemption: the step stops mid-way, its progress kept
                self.cut(t)
                self.fire(t)
                continue
            while self.next_event() <= self.step_end:  # events during a step are decided at their own time
                self.fire(self.next_event())  # and acted on at the next boundary (an arrival may delay its end)
            self.end_step()
        self.finish()
        return self.preemptions

    def finish(self) -> None:
        for r in self.sched.shed:
            r.state, r.finish_reason = RequestState.FAILED, "error"

    def begin_step(self) -> float | None:
        """Start the device's next step and return when it ends (None: nothing to run). As the engine's
        loop: a decode step when one is due or no prefill is chosen; else the chosen batch's next step
        (or what is left of a cut one), switched to if it is not the one running (a preemption when
        that one is unfinished). `lookahead`: events the instance cannot see (a fleet's next arrival)
        also stop a fast-forward."""
        batch = self.sched.chosen
        if self.answers.running and (batch is None or self.clock.t >= self.answers.next_step_at):
            if evicted := self.answers.make_room(self._give_back):
                for r in evicted:  # recomputed but for what is still cached
                    r.num_computed_tokens = self.cached_tokens(r)
                    self.sched.on_evicted(r)
            if self.answers.running:
                return self._begin_decode()
            batch = self.sched.chosen
        if batch is None:
            return None
        # idle since its last step ended: the batch pays for the wake-up
        woke = self.loop.current is None and self.clock.t > self.busy_until and not self.cfg.ideal
        self.loop.switch(batch)
        start = self.clock.t
        left = self.step_left.pop(batch.batch_id, None)
        if left is None and not self.cfg.ideal:
            self._fast_forward(batch)
            start = self.clock.t
        self.step_start, self.step_end = start, start + (self._step_s(batch) if left is None else left)
        if woke:
            self.step_end += self.cfg.idle_wake_s
        return self.step_end

    def cut(self, t: float) -> None:
        """Ideal preemption: the running step stops at t, before its end, its progress kept."""
        batch = self.loop.current
        assert batch is not None and self.step_end is not None
        self.step_left[batch.batch_id] = self.step_end - t
        batch.exec_s += t - self.step_start
        self.loop.device_free_at = t
        self.step_end = None

    def _begin_decode(self) -> float:
        streams = self.answers.running.values()
        d = self.truth.decode_step_s(len(streams), sum(s.req.num_tokens for s in streams))
        d *= self.machine.at(self.clock.t) * (self.rng.lognormvariate(0, self.cfg.noise) if self.cfg.noise else 1.0)
        self.decoding, self.step_start, self.step_end = True, self.clock.t, self.clock.t + d
        return self.step_end

    def _end_decode(self, now: float) -> None:
        """Each running answer's next token, as the engine's decode step hands them out."""
        self.decoding = False
        self.loop.device_free_at = now
        for stream in list(self.answers.running.values()):
            stream.req.times.last_token_time = now
            if reason := stream.push(TOKEN).finish_reason:
                self._finished(stream.req, reason, now)
        self.answers.next_step_at = math.inf
        self.answers.schedule(now)

    def _give_back(self, r: Request) -> None:
        self.prefixes.answered(r)  # what it wrote stays findable (the next turn's, a recompute's)
        self.kv.free(r.block_table)

    def _finished(self, r: Request, reason: str, now: float) -> None:
        """Its answer is done: its KV goes back, and requests waiting for KV get a decision."""
        r.finish_reason, r.times.finish_time, r.state = reason, now, RequestState.FINISHED
        self.answers.drop(r.request_id)
        self._give_back(r)
        if self.sched.waiting and self.sched.chosen is None:
            self.sched.on_kv_freed()

    def end_step(self) -> None:
        """The running step ends (`begin_step`'s time): a decode step's tokens are out, or the batch
        advances, completing or reporting progress at the engine's cadence."""
        if self.decoding:
            assert self.step_end is not None
            self.clock.t, self.step_end, self.busy_until = self.step_end, None, self.step_end
            self._end_decode(self.clock.t)
            return
        batch, end = self.loop.current, self.step_end
        assert batch is not None and end is not None
        self.clock.t, self.step_end, self.busy_until = end, None, end
        # The host's time after the last step is not the batch's (the engine measures only its steps,
        # and the correction learns from those): the device went idle when the last step ended.
        host_s = self._host_s() if batch.next_step >= len(batch.steps) else 0.0
        batch.exec_s += end - self.step_start - host_s
        if self.loop.step(batch):  # the engine's own step: progress reports at its cadence
            self.loop.device_free_at = end - host_s
            self._complete(batch)

    def _host_s(self) -> float:
        """The host's time to finish a batch, which the final next() stands for (none in the ideal bound)."""
        return 0.0 if self.cfg.ideal else self.truth.batch_host_s

    def _step_s(self, batch: PrefillBatch) -> float:
        if batch.next_step >= len(batch.steps):
            return self._host_s()  # the final next(): the first token, and the next decision
        d = batch.steps.cost(batch.next_step) * self.true_rate(batch)
        return d * self.rng.lognormvariate(0, self.cfg.noise) if self.cfg.noise else d

    def _fast_forward(self, batch: PrefillBatch) -> None:
        """Jump over the steps that end before the next event, the next correction or the machine's next
        change: nothing can happen at their boundaries, so stepping through them one by one is waste."""
        plan, i = batch.steps, batch.next_step
        if i >= len(plan):
            return
        t = self.clock.t
        observe_in = self.sched.progress_every_s - (batch.exec_s - batch.observed[1])
        until = min(self.next_event(), self.lookahead, self.machine.next_change_after(t),
                    t + max(observe_in, 0.0), self.answers.next_step_at if self.answers.running else math.inf)
        rate = self.true_rate(batch) * (self.rng.lognormvariate(0, self.cfg.noise) if self.cfg.noise else 1.0)
        base = plan.cost_before(i)
        j = min(len(plan), plan.first_step_ending_after(base + (until - t) / rate))
        if j > i:
            elapsed = (plan.cost_before(j) - base) * rate
            self.clock.t += elapsed
            batch.exec_s += elapsed
            self.runs[batch.batch_id].seek(j - 1)
            batch.advance()  # steps i..j-1 at once: nothing happens at their boundaries

    def _complete(self, batch: PrefillBatch) -> None:
        """The engine's completion (engine/core/prefill.py), with the virtual device's first tokens: each
        answer then decodes with the engine's `Answers`."""
        now = self.loop.end(batch)
        del self.runs[batch.batch_id]
        assert batch.began_at is not None
        self.batches.append(BatchRecord(batch.began_at, batch.num_tokens, batch.total_cost, batch.exec_s))
        unfinished = []
        for r, whole in zip(batch.requests, batch.completes_prefills, strict=True):
            self.prefixes.prefilled(r)
            if not whole:  # one chunk of its prompt is done: it queues for the next
                r.state = RequestState.WAITING
                unfinished.append(r)
                continue
            if not r.times.evictions:
                self.done.append(r)  # its first token (a recompute's is its next one)
            if reason := self.answers.start(r, TOKEN, now).finish_reason:
                self._finished(r, reason, now)
        self.loop.complete(batch, unfinished)
        self.answers.schedule(now)
