"""The engine's front: what other threads send it (typed messages through its inbox: engine/core/messages.py)
and what they read of it (the snapshot it publishes). Everything here but `_publish` runs on the caller's
thread and touches no engine state: the engine thread owns that (engine/core/owner.py)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

from engine.core import handoff
from engine.core.messages import ENGINE_STOPPED, Arrive, Call, Cancel, EngineSnapshot, ImportKV, Message, Refusal
from engine.core.request import Request, Sampled, SamplingParams
from engine.model.cost import SIZE_CLASSES
from engine.protocol.worker import WorkerLoad

log = logging.getLogger("flowprefill.engine")
_GENERATED = itertools.count()  # `Engine.generate`'s request ids (an object's id() is reused once it is freed)
# How stale a published snapshot's predicted backlog may be while the engine runs (routing polls it every
# second), for a queue longer than PUBLISH_BACKLOG_FRESH: it predicts every waiting request, 2.7 us each once
# the correction has moved, which publishing at each finished answer and arrival repeated: 0.4 ms a publish
# with 300 waiting, half a batch's host time.
PUBLISH_BACKLOG_S = 0.01
# A queue this short has its waiting requests predicted afresh whenever the queue or the cost model moved
# since (some 3 us a request): an answer's load report, read as it ends, must not still count its own work
# (an empty queue reports none). Predicting them anyway at every periodic publish made it 17 us with 5
# waiting and 36 us with 15, against 7-9 us (one EPYC core).
PUBLISH_BACKLOG_FRESH = 16
# Between events (a decision, an answer starting or ending, KV taken or freed) the snapshot is refreshed this
# often, for a running batch's shrinking backlog and the learned machine factor: building it takes some 25 us,
# 1 % of a 2 ms step were it done after each.
PUBLISH_EVERY_S = 0.01
T = TypeVar("T")


class EngineFront:
    """Submission, cancellation, calls and the published snapshot (a part of `Engine`)."""

    def submit(self, reqs: list[Request], sheddable: bool = False,
               on_queued: Callable[[], None] | None = None) -> Future[Refusal | None]:
        """Queue one HTTP request's engine requests (an arrival event), or have them refused together: the
        future is set on the engine thread to None (queued; `on_queued` ran first, there) or to a
        `Refusal` (the queue is full, or, `sheddable`, they could not be served even late). Raises
        ValueError for bad input (a prompt this worker cannot serve, an id already in use)."""
        verdict: Future[Refusal | None] = Future()
        self._arrive(reqs, Arrive(tuple(reqs), sheddable, verdict, on_queued))
        return verdict

    def add_request(self, req: Request) -> None:
        """Queue a request, never refused (no admission). Raises ValueError for bad input."""
        self._arrive([req], Arrive((req,)))

    def _arrive(self, reqs: list[Request], msg: Arrive) -> None:
        for req in reqs:
            self.validate(req)
            self.prefixes.hash_prompt(req)  # its blocks' hashes, here: the engine thread only looks them up
        self._register(reqs)
        self._post_or_forget(reqs, msg)

    def _post_or_forget(self, reqs: list[Request], msg: Message) -> None:
        try:
            self._post(msg)
        except RuntimeError:  # the engine has stopped: their ids are free again
            for r in reqs:
                self._unregister(r.request_id)
            raise

    def validate(self, req: Request) -> None:
        """Raises ValueError for a request this worker cannot serve (its model, its cache)."""
        req.check(self.model.cfg.vocab_size, self.model.cfg.max_position_embeddings,
                  self.kv.num_blocks * self.kv.block_size)

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is in the engine (queued, prefilling or decoding)."""
        with self._ids_lock:
            return request_id in self._ids

    def cancel(self, request_id: str) -> None:
        self._post(Cancel(request_id))

    def add_prefilled(self, req: Request, kv: dict[str, torch.Tensor], first: Sampled) -> None:
        """Decode a request another worker prefilled (PD disaggregation): its prompt's KV
        (`k.{layer}` / `v.{layer}`: [prompt tokens, kv heads, head dim]) and its first token.
        Raises ValueError for KV that does not fit this model or prompt."""
        self.validate(req)
        handoff.check(self.model.cfg, req, kv, first)
        req.prefilled_elsewhere = True
        self._register([req])
        self._post_or_forget([req], ImportKV(req, kv, first))

    def call(self, fn: Callable[[], T], timeout_s: float | None = 30.0) -> T:
        """Run `fn` as the engine's state's owner: on the engine thread while it runs (its result, or its
        exception raised here), on this thread before it starts or after it ended."""
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            return fn()
        done: Future[T] = Future()
        self._post(Call(fn, done))
        return done.result(timeout_s)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 request_ids: list[str] | None = None, timeout_s: float | None = None,
                 **request_fields: object) -> list[Request]:
        """Blocking convenience: run prompts to completion (the engine must be started). Each request's
        id is `request_ids`' or one no other call here has used (observers that pool measurements by
        id, as `plan`'s engine pass does, must not see two prompts as one); past `timeout_s` seconds of
        waiting for one, TimeoutError."""
        done = [threading.Event() for _ in prompts]
        reqs = []
        for i, ids in enumerate(prompts):
            event = done[i]
            rid = request_ids[i] if request_ids else f"gen-{next(_GENERATED)}"
            req = Request(request_id=rid, prompt_token_ids=ids,
                          sampling=sampling or SamplingParams(), **request_fields)  # type: ignore[arg-type]
            req.sink = lambda out, e=event: out.finish_reason and e.set()
            reqs.append(req)
            self.add_request(req)
        for e, req in zip(done, reqs, strict=True):
            if not e.wait(timeout_s):
                raise TimeoutError(f"request {req.request_id} ({len(req.prompt_token_ids)} prompt tokens) did not "
                                   f"finish in {timeout_s} s")
        return reqs

    @property
    def snapshot(self) -> EngineSnapshot:
        """The queue as the engine thread last published it (engine/core/messages.py)."""
        return self._snapshot

    @property
    def num_waiting(self) -> int:
        return self._snapshot.load.waiting

    @property
    def num_decoding(self) -> int:
        return self._snapshot.load.decoding

    def load(self) -> WorkerLoad:
        """The queue's state as a gateway routes on it (GET /load): the engine's last snapshot."""
        return self._snapshot.load

    def admission(self, reqs: list[Request], sheddable: bool) -> Refusal | None:
        """Whether these requests would be refused now (`submit`'s verdict, without queuing them)."""
        return self.call(lambda: self._admit(reqs, sheddable))

    def _register(self, reqs: list[Request]) -> None:
        """Their ids are in use until each one's last output (all or none: ValueError for one in use)."""
        ids = [r.request_id for r in reqs]
        with self._ids_lock:
            if (dup := next((i for k, i in enumerate(ids) if i in self._ids or i in ids[:k]), None)) is not None:
                raise ValueError(f"duplicate request id {dup!r}")
            self._ids.update(ids)

    def _unregister(self, request_id: str) -> None:
        with self._ids_lock:
            self._ids.discard(request_id)

    def _post(self, msg: Message) -> None:
        with self._cv:
            if self._stop:
                raise RuntimeError(ENGINE_STOPPED)
            self._inbox.append(msg)
            self._cv.notify()

    def _events_mark(self) -> tuple[int, int, int]:
        return self.scheduler.invocations, len(self.answers.running), self.kv.num_free_blocks

    def _publish_if_changed(self) -> None:
        """After an iteration: a new snapshot when an event changed the queue, or PUBLISH_EVERY_S on."""
        mark, at = self._published
        if self._events_mark() != mark or time.perf_counter() - at >= PUBLISH_EVERY_S:
            self._publish()

    def _publish(self, full: bool = False, added: Sequence[Request] = ()) -> None:
        """A new snapshot of the queue for other threads. The waiting requests' predicted backlog (a prediction
        each) is recomputed when `full`, or when the queue or the cost model moved since: a short queue's at
        once, a longer one's at most every PUBLISH_BACKLOG_S, the requests just `added` having their own
        predictions added in between. What the formed batches still owe, at every publish."""
        s, now = self.scheduler, time.perf_counter()
        short = len(s.waiting) + len(s.pool) <= PUBLISH_BACKLOG_FRESH
        moved = (s.invocations, len(s.waiting), id(self.cost), self.cost.revision)  # what its predictions stand on
        if full or (moved != self._backlog_key and (short or now - self._backlog_at >= PUBLISH_BACKLOG_S)):
            self._backlog, self._backlog_at, self._backlog_key = s.backlog(), now, moved
        elif added:
            by_class = dict(self._backlog[1])
            for r in added:
                by_class[r.slo_class] = by_class.get(r.slo_class, 0.0) + s.predict_s(r)
            self._backlog = self._backlog[0], by_class
        else:  # the formed batches' part moves at every step of the running one
            self._backlog = sum(s.remaining_s(b) for b in s.pool), self._backlog[1]
        formed, by_class = self._backlog
        running = s.chosen is not None
        self._snapshot = EngineSnapshot(
            WorkerLoad(waiting=len(s.waiting), decoding=len(self.answers.running),
                       suspended_batches=max(0, len(s.pool) - 1), predicted_backlog_s=formed + sum(by_class.values()),
                       predicted_backlog_by_class_s=by_class, kv_cache_usage=self.kv.usage,
                       machine_factor=self.cost.machine),
            evicted=len(self.answers.evicted),
            suspended=max(0, len(s.pool) - running), cached_blocks=self.kv.num_cached_blocks,
            corrections=tuple(self.cost.factor(t) for t in (*SIZE_CLASSES, SIZE_CLASSES[-1] + 1)))
        self._published = self._events_mark(), now
