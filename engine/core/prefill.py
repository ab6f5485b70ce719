"""Operator-level preemption: a prefill batch that advances one operator step at a time, and the
engine loop's prefill part that steps it.

The loop (`PrefillLoop`) calls `advance()` while this batch is the scheduler's choice; the moment the
choice changes, it suspends the batch and simply stops calling it. The suspended generator keeps the
activations and the KV already written, so `advance()` later resumes exactly where it stopped. The
engine thread runs the loop on the model (engine/core/engine.py), the simulator on a virtual device
whose steps advance a virtual clock (engine/sim/simulator.py): one loop, so the two cannot drift apart.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.core.kv_cache import KVCache
from engine.core.request import Logprob, Request, RequestState, Suspension
from engine.core.sampling import prompt_logprobs
from engine.model.cost import OpCost, SeqSpan
from engine.model.llama import LlamaModel
from engine.model.plan import Plan, plan_prefill

if TYPE_CHECKING:  # the scheduler's pool holds batches
    from engine.core.scheduler import Scheduler

_batch_ids = itertools.count()


class RunAhead:
    """Bounds how far the host runs ahead of an asynchronous device.

    CUDA kernels are queued: unbounded, the host would queue a whole prefill in milliseconds and a
    preemption would then wait for all of it on the device. Here, after queueing a step, the host
    waits for the oldest queued steps to finish until at most `limit_s` of predicted work is queued,
    but never for the step it has just queued: the device runs that one while the host prepares
    the next, so it never idles between steps, and a stop waits for at most the running step and
    the one queued behind it (two budgets). Host-side step times then track device time, which is
    what the cost model learns from. On a CPU every step is synchronous and this does nothing.
    """

    def __init__(self, device: torch.device, limit_s: float = 0.002,
                 new_event: Callable[[], Any] | None = None) -> None:
        self.limit_s = limit_s
        self._new_event = new_event or (torch.cuda.Event if device.type == "cuda" else None)
        self._queue: deque[tuple[Any, float]] | None = deque() if self._new_event else None
        self._queued_s = 0.0

    @property
    def queued(self) -> int:
        return len(self._queue or ())

    @property
    def queued_s(self) -> float:
        """Predicted time of the queued steps (some may have finished already)."""
        return self._queued_s

    def step_queued(self, predicted_s: float) -> None:
        if self._queue is None or self._new_event is None:
            return
        event = self._new_event()
        event.record()
        self._queue.append((event, predicted_s))
        self._queued_s += predicted_s
        while len(self._queue) > 1 and self._queued_s > self.limit_s:
            oldest, cost = self._queue.popleft()
            oldest.synchronize()  # releases the GIL while it waits
            self._queued_s -= cost

    def drain(self) -> None:
        """Wait until every queued step has finished on the device."""
        if self._queue:
            self._queue[-1][0].synchronize()
            self._queue.clear()
        self._queued_s = 0.0


class PrefillBatch:
    """Requests prefilled together. `run` executes `steps` (the model's forward, or the simulator's
    virtual device): each next() runs one or more of them and yields the index of the last one run,
    and it returns the last-token logits. `timer`: what its steps' times are measured on (the
    simulator's: its virtual clock)."""

    def __init__(self, requests: list[Request], spans: list[SeqSpan], steps: Plan,
                 run: Generator[int, None, torch.Tensor | None], device: torch.device | None = None,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.batch_id = next(_batch_ids)
        self.requests, self.spans, self.steps = requests, spans, steps
        self.total_cost = steps.total_cost
        self._cost_done = 0.0
        self.next_step = 0
        self.finished = False
        self.exec_s = 0.0  # measured time spent in its steps
        # What the cost model's correction has already learned from: (calibrated seconds, measured seconds)
        self.observed: tuple[float, float] = (0.0, 0.0)
        self.logits: torch.Tensor | None = None
        # Prompt logprobs: per asking request (its index, first position, rows), and the final
        # hidden states of those rows, in that order, once the batch is done.
        self.keep: list[tuple[int, int, int]] = []
        self.kept: torch.Tensor | None = None
        self._run, self._timer = run, timer
        self._device = RunAhead(device or torch.device("cpu"))
        self.segment_start: float | None = None
        self.began_at: float | None = None  # its first step's start (the engine's clock)
        # The host gap before it: from the device's last step (prefill or decode) or its first request's
        # arrival, whichever was later, to its first step: the device idle while its work waited.
        self.host_gap_s: float | None = None

    @classmethod
    def on_model(cls, requests: list[Request], spans: list[SeqSpan], model: LlamaModel, kv: KVCache,
                 cost: OpCost, budget_s: float | None) -> PrefillBatch:
        # Prompt logprobs (echo with logprobs): each asking request's rows whose next token is a
        # prompt token are kept, and the plan computes the last layer for every row.
        keep: list[tuple[int, int, int]] = []  # (request, first position, rows)
        rows: list[int] = []
        row0 = 0
        for i, (r, s) in enumerate(zip(requests, spans, strict=True)):
            count = max(0, min(s.start + s.length, r.num_prompt_tokens - 1) - s.start)
            if r.sampling.prompt_logprobs is not None and not r.output_token_ids and (count or s.start == 0):
                keep.append((i, s.start, count))
                rows += range(row0, row0 + count)
            row0 += s.length
        steps = plan_prefill(cost, spans, budget_s, last_token_only=not rows)
        tokens = [r.prefill_token_ids[s.start : s.start + s.length] for r, s in zip(requests, spans, strict=True)]
        run = model.prefill(tokens, spans, [r.block_table for r in requests], kv, steps, keep_rows=rows or None)
        batch = cls(requests, spans, steps, run, model.device)
        batch.keep = keep
        return batch

    def score_prompts(self, logits_of: Callable[[torch.Tensor], torch.Tensor]
                      ) -> list[tuple[Request, list[Logprob | None] | Exception]]:
        """Once it is done: prompt logprobs (completions' echo) of its asking requests, each kept
        row's logits scored against the prompt token after it (None for a prompt's first token), or
        the exception a request's scoring raised (out of memory on a large vocabulary): it fails alone."""
        out: list[tuple[Request, list[Logprob | None] | Exception]] = []
        at = 0
        for i, first, count in self.keep:
            r, rows = self.requests[i], slice(at, at + count)
            at += count
            if r.state.done:
                continue
            try:
                hidden = self.kept[rows] if count else None  # type: ignore[index]
                scored = prompt_logprobs(logits_of, hidden, r.prompt_token_ids[first + 1:first + 1 + count],
                                         r.sampling.prompt_logprobs or 0)
                out.append((r, [*([None] if first == 0 else []), *scored]))
            except Exception as exc:
                out.append((r, exc))
        self.kept = None
        return out

    @property
    def completes_prefills(self) -> list[bool]:
        """Per request: does this batch finish its prefill (else it is one chunk of it)?"""
        return [s.start + s.length == r.num_tokens for r, s in zip(self.requests, self.spans, strict=True)]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.spans)

    @property
    def head(self) -> Request:
        return self.requests[0]

    @property
    def remaining_s(self) -> float:
        """Predicted time to finish from where it stands (what a suspended batch still owes)."""
        return self.total_cost - self._cost_done

    @property
    def remaining_base_s(self) -> float:
        """What it still owes in the calibrated model's units (before the online correction)."""
        return (self.total_cost - self._cost_done) / self.steps.scale

    def take_progress(self) -> tuple[float, float]:
        """The steps run since the last call: their predicted seconds in the calibrated model's units
        and the seconds they measured (what the correction learns from, mid-way and at the end)."""
        base, measured = self._cost_done / self.steps.scale, self.exec_s
        done = (base - self.observed[0], measured - self.observed[1])
        self.observed = (base, measured)
        return done

    @property
    def started(self) -> bool:
        return self.next_step > 0

    def advance(self) -> bool:
        """Run its next operator step. True when the whole prefill is finished."""
        t0 = self._timer()
        try:
            i = next(self._run)
            done = self.steps.cost_before(i + 1)
            self._device.step_queued(done - self._cost_done)
        except StopIteration as stop:
            self._device.drain()  # the measured time includes the device's last steps
            value = stop.value
            self.logits, self.kept = value if isinstance(value, tuple) else (value, None)
            self.finished = True
            return True
        finally:
            self.exec_s += self._timer() - t0
        self._cost_done = done
        self.next_step = i + 1
        return False

    def wait_device(self) -> tuple[int, float]:
        """Block until this batch's queued steps have run (a suspension is complete on the device).
        Returns how many steps were queued and their predicted seconds: what the wait was for."""
        queued = (self._device.queued, self._device.queued_s)
        t0 = self._timer()
        self._device.drain()
        self.exec_s += self._timer() - t0
        return queued

    # -- bookkeeping of execution segments and suspensions (what telemetry reports) -------------
    def begin_segment(self, now: float) -> None:
        self.segment_start = now
        if self.began_at is None:
            self.began_at = now
        for r in self.requests:
            if r.state.done:  # cancelled while in this batch: it stays cancelled
                continue
            r.state = RequestState.PREFILLING
            if r.times.prefill_start is None:
                r.times.prefill_start = now
            if r.times.suspensions and r.times.suspensions[-1].end is None:
                r.times.suspensions[-1].end = now

    def end_segment(self, now: float) -> None:
        if self.segment_start is not None:
            for r in self.requests:
                r.times.segments.append((self.segment_start, now))
        self.segment_start = None

    def suspend(self, now: float, decided_at: float, by: PrefillBatch | None,
                queued: tuple[int, float] = (0, 0.0)) -> None:
        self.end_segment(now)
        step = self.steps[min(self.next_step, len(self.steps) - 1)]
        done_rows = step.rows[0] if self.next_step < len(self.steps) else self.num_tokens
        for r in self.requests:
            if r.state.done:
                continue
            r.state = RequestState.SUSPENDED
            r.times.suspensions.append(Suspension(
                start=now, preempted_by=by.head.request_id if by else "",
                by_class=by.head.slo_class if by else "", layer=step.layer, operator=step.op,
                tokens_done=done_rows, stop_latency_s=max(0.0, now - decided_at),
                queued_steps=queued[0], queued_predicted_s=queued[1]))

    def close(self) -> None:
        """Drop the suspended computation (its activations are released with the generator)."""
        self._run.close()


def _no_observers(event: str, *args: object) -> None:
    """What a loop without observers tells (the simulator's)."""


class PrefillLoop:
    """Which batch's steps run, and the bookkeeping of every switch and completion. `notify`: the
    engine's observers (telemetry), called as `notify(event, *args)`."""

    def __init__(self, scheduler: Scheduler, clock: Callable[[], float],
                 notify: Callable[..., None] = _no_observers) -> None:
        self.scheduler, self.clock, self.notify = scheduler, clock, notify
        self.current: PrefillBatch | None = None  # the batch whose steps ran last (None: none since one ended)
        self.preemptions = 0
        self.device_free_at = -math.inf  # when the device's last step (prefill or decode) ended, on `clock`

    def step(self, batch: PrefillBatch) -> bool:
        """Run the running batch's next step (`switch` made it so). True when its prefill is done: the
        caller then `end`s it. Every `progress_every_s` of measured time the correction learns."""
        finished = batch.advance()
        self.device_free_at = self.clock()
        if not finished and batch.exec_s - batch.observed[1] >= self.scheduler.progress_every_s:
            self.scheduler.on_progress(batch)
        return finished

    def switch(self, batch: PrefillBatch) -> None:
        """The per-boundary check: `batch` (the scheduler's choice) runs from now. When it is not the one
        that ran, that one is suspended where it stands if it still owes work, and a batch's first
        segment records its host gap (the device idle while its work waited), which the scheduler's
        predictions add per batch."""
        if batch is self.current:
            return
        now, prev = self.clock(), self.current
        preempted = prev is not None and prev in self.scheduler.pool
        if preempted:
            assert prev is not None
            queued = prev.wait_device()  # on CUDA its last queued steps may still run: the stop ends there
            now = self.clock()
            prev.suspend(now, self.scheduler.chosen_at, batch, queued)
            self.preemptions += 1
            self.notify("on_segment_end", prev, now)
        if batch.began_at is None:
            waited_from = max(self.device_free_at, min(r.arrival_time for r in batch.requests))
            batch.host_gap_s = max(0.0, now - waited_from)
            self.scheduler.on_host_gap(batch.host_gap_s)
        batch.begin_segment(now)
        self.notify("on_segment_start", batch, now)
        if preempted:
            self.notify("on_preempt", prev, batch)
        self.current = batch

    def end(self, batch: PrefillBatch) -> float:
        """`batch`'s last step has run: its segment ends, the correction learns from its last steps, and
        each request has computed its span. Returns the time it ended."""
        now = self.clock()
        batch.end_segment(now)
        self.notify("on_segment_end", batch, now)
        self.scheduler.on_progress(batch)
        for r, span in zip(batch.requests, batch.spans, strict=True):
            r.num_computed_tokens = span.start + span.length
        return now

    def complete(self, batch: PrefillBatch, unfinished: Sequence[Request]) -> None:
        """Its first tokens are out: the batch leaves the scheduler's pool, `unfinished` (requests with
        prompt left: one chunk of theirs was done) queue again, and the next decision is made."""
        self.scheduler.on_completion(batch, unfinished)
        self.dropped(batch)

    def dropped(self, batch: PrefillBatch) -> None:
        """`batch` left the device (completed, cancelled or failed): none runs until the next step.
        Until then an engine that fails finds it here."""
        if self.current is batch:
            self.current = None
