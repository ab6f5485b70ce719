"""The engine: one thread that executes the scheduler's chosen prefill batch operator by operator,
interleaves decode steps at operator boundaries, and streams tokens back."""

from __future__ import annotations

import gc
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

from engine.core import handoff
from engine.core.config import EngineConfig, auto_kv_tokens, kv_bytes_per_token
from engine.core.cpu_affinity import CorePinning, on_passing_thread, team_ids
from engine.core.decode import Answers
from engine.core.kv_cache import KVCache, OutOfBlocks
from engine.core.messages import Arrive, Call, Cancel, EngineSnapshot, ImportKV, Message, Refusal
from engine.core.observer import EngineObserver
from engine.core.predictor import StoredProfile, load_cost, stored_cost
from engine.core.prefill import PrefillBatch
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request, RequestState, Sampled, SamplingParams, TokenOutput
from engine.core.sampling import sample
from engine.core.scheduler import UNCONFIRMED_SPEEDUP, Policy, Scheduler, make_policy
from engine.core.thread_cpu import ThreadCPU, readable
from engine.model import load_model, use_device
from engine.model.plan import ATTN_IN, FFN, MLP, SIZE_CLASSES, SeqSpan
from engine.protocol.slo import SHED_ERROR, SHED_REASON
from engine.protocol.worker import WorkerLoad

log = logging.getLogger("flowprefill.engine")
ENGINE_STOPPED = "the engine shut down"  # the error of every request still in it when it stops
_GENERATED = itertools.count()  # `Engine.generate`'s request ids (an object's id() is reused once it is freed)
# How stale a published snapshot's predicted backlog may be while the engine runs (routing polls it every
# second): it predicts every waiting request, 2.7 us each once the correction has moved, which publishing
# at each finished answer and arrival repeated: 0.4 ms a publish with 300 waiting, half a batch's host time.
PUBLISH_BACKLOG_S = 0.01
# Between events (a decision, an answer starting or ending, KV taken or freed) the snapshot is refreshed this
# often, for a running batch's shrinking backlog and the learned machine factor: building it takes some 25 us,
# 1 % of a 2 ms step were it done after each.
PUBLISH_EVERY_S = 0.01
T = TypeVar("T")


def _refusal_message(req: Request, predicted_s: float, factor: float, confirmed: bool) -> str:
    by = (f"its {req.ttft_target_s * 1000:g} ms TTFT target" if req.shed_late else
          f"{req.late_s * 1000:g} ms past its {req.ttft_target_s * 1000:g} ms TTFT target (its class's late bound)")
    speed = (f"at the speed observed now, {factor:.2f}x the calibrated time" if confirmed else
             f"calibration alone, no batch of its size has run yet; refused only as it misses even "
             f"{UNCONFIRMED_SPEEDUP:g}x faster")
    return (f"the request cannot be served even {by} here: its prefill alone is predicted to take "
            f"{predicted_s:.2f} s ({speed}); retry later or with a looser class")


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, policy: str | Policy = "flowprefill",
                 clock: Callable[[], float] = time.monotonic, record_profile: bool = True,
                 profile: StoredProfile | None = None) -> None:
        """`record_profile=False`: read the cached cost profile without adding a calibration to it
        (a simulator's probe, engine/core/predictor.py's `load_cost`). `profile`: predict with the profile
        read from a file instead (`read_profile`: a plan.json's, or another machine's cache file)."""
        self.cfg = cfg = cfg or EngineConfig()
        self.record_profile, self.profile = record_profile, profile
        self.pinning = CorePinning(cfg.cpu_cores) if cfg.cpu_cores else None
        if self.pinning is not None:  # before calibration and before the engine thread starts (it inherits)
            self.pinning.pin_compute()
        threads = cfg.num_threads or (len(self.pinning.cores) if self.pinning else None)
        if threads:
            torch.set_num_threads(threads)
        if cfg.device == "cpu":  # its OpenMP team must not outlive it (cpu_affinity.on_passing_thread)
            on_passing_thread(self._build)
        else:
            self._build()
        self.prefixes = PrefixCache(self.kv, cfg.prefix_caching)
        if cfg.kv_reservation not in ("grow", "full"):
            raise ValueError(f"kv_reservation {cfg.kv_reservation!r}: choose grow or full")
        self.answers = Answers(self.kv, self.tokenizer)
        self.budget_s = cfg.step_budget_ms / 1000 if cfg.preemptible else None
        self.cost.budget_s = self.budget_s
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.clock = clock
        self.scheduler = Scheduler(self.policy, self._new_batch, self.cost, self.kv, cfg.max_batch_tokens, clock,
                                   self._reserve_tokens, self._headroom_blocks, cfg.late_share)
        self.observers: list[EngineObserver] = []
        self.preemptions = 0
        self._cv = threading.Condition()  # guards the inbox and `_stop`: all other state is the engine thread's
        self._inbox: deque[Message] = deque()
        self._ids: set[str] = set()  # ids in use, from submission to the last output (`has_request`)
        self._ids_lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._cancels: deque[str] = deque()
        self._imports: deque[tuple[Request, dict[str, torch.Tensor], Sampled]] = deque()
        self._current: PrefillBatch | None = None
        self._device_free_at = -math.inf  # when the last step (prefill or decode) ended, the engine's clock
        self._stop = False
        self.thread_cpu: ThreadCPU | None = None  # its compute threads' CPU and the serving side's, once running
        self._backlog: tuple[float, dict[str, float]] = (0.0, {})
        self._backlog_at = -math.inf
        self._published: tuple[tuple[int, int, int], float] = ((-1, -1, -1), -math.inf)  # (events mark, when)
        self._snapshot = EngineSnapshot(WorkerLoad())
        self._publish(full=True)
        self._thread = threading.Thread(target=self._loop, name="flowprefill-engine", daemon=True)

    def _build(self) -> None:
        """The model, its KV cache and its calibrated cost: everything the engine computes before it runs."""
        cfg = self.cfg
        if self.pinning is not None:  # calibration runs on this thread's team: bound as the engine's will be
            self.pinning.bind_threads(torch.get_num_threads())
        # Each phase logged as it ends: a first start with a new model takes tens of seconds on a CPU.
        t0 = time.perf_counter()
        self.model, self.tokenizer = load_model(cfg)
        log.info("model %s loaded (%s, %s) in %.1f s", self.model.cfg.name, cfg.dtype, cfg.device,
                 time.perf_counter() - t0)
        dtype = getattr(torch, cfg.dtype)
        tokens = cfg.kv_capacity_tokens or auto_kv_tokens(self.model.cfg, dtype.itemsize, cfg.device)
        t0 = time.perf_counter()
        self.kv = KVCache(self.model.cfg, cfg.kv_block_size, tokens, dtype, torch.device(cfg.device))
        log.info("KV cache: %d tokens, %.2f GiB, allocated in %.1f s", self.kv.num_blocks * self.kv.block_size,
                 self.kv.num_blocks * self.kv.block_size * kv_bytes_per_token(self.model.cfg, dtype.itemsize) / 2**30,
                 time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.cost = (stored_cost(self.model, self.profile) if self.profile is not None
                     else load_cost(self.model, record=self.record_profile and cfg.calibrate))
        log.info("operators profiled in %.1f s", time.perf_counter() - t0)
        if self.model.activations is not None:  # the longest prompt's buffers mapped before it arrives
            self.model.activations.warm(min(self.model.cfg.max_position_embeddings, tokens))
        if self.model.graphs is not None:
            self.model.graphs.capture_all()
        if self.model.linear == "onednn":  # its kernels are built per row count: before the first request
            self._warm_steps()

    def _warm_steps(self) -> None:
        """Run every row count the prefill's and decode's row-wise steps can have once. oneDNN builds a
        kernel at the first call of each, 2.6 ms for an FFN step of the embedded model, one thread (a
        2 ms step run at 4.6 ms): without this, a fresh worker's first prefills of each size run 8-13 %
        slower than the same sizes later."""
        cfg, t0 = self.cfg, time.perf_counter()
        budget_s = cfg.step_budget_ms / 1000 if cfg.preemptible else None
        attn_in = self.cost.step_rows(ATTN_IN, budget_s, cfg.max_batch_tokens)
        ffn = self.cost.step_rows(FFN, budget_s, cfg.max_batch_tokens)
        mlp = self.cost.step_rows(MLP, budget_s, cfg.max_batch_tokens)  # an FFN cut by the MLP's columns
        self.model.warm_steps(attn_in, ffn, mlp)
        log.info("row-wise kernels warmed: %d attention-input, %d FFN and %d MLP-slice row counts in %.2f s",
                 len(attn_in), len(ffn), len(mlp), time.perf_counter() - t0)

    # -- public API (any thread): messages in, outputs and snapshots out ---------------------------
    def start(self) -> Engine:
        self._thread.start()
        if self.pinning is not None:  # the caller goes on serving: off the compute cores
            self.pinning.release_caller()
        return self

    def shutdown(self) -> None:
        """Stops the engine thread; every request still in it ends with the error ENGINE_STOPPED
        (a worker's answers in flight at its shutdown deadline). Idempotent."""
        with self._cv:
            if self._stop:
                return
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()
        self._notify("on_shutdown")

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

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        use_device(self.model.device)  # this thread's kernels, events and graph replays
        if self.pinning is not None:  # the team this thread's parallel regions run on: one thread per core
            self.pinning.bind_threads(torch.get_num_threads())
        self.thread_cpu = ThreadCPU(team_ids(torch.get_num_threads())) if readable() else None
        self._claim(threading.current_thread())
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._has_work()):
                    self._publish(full=True)  # idle: what it reports is exact
                    self._cv.wait()
                if self._stop:
                    break
            try:
                self._iteration()
            except Exception:  # a bug must not strand requests: fail what was running, go on
                log.exception("engine iteration failed")
                self._fail_current("internal engine error")
            self._publish_if_changed()
        self._stopped()

    def _has_work(self) -> bool:
        return bool(self._cancels or self._imports_ready() or self.scheduler.chosen or self.answers.running
                    or self.scheduler.shed)

    def _stopped(self) -> None:
        """The engine thread's last act: every request in it, or still in its inbox, ends with ENGINE_STOPPED."""
        with self._cv:
            inbox, self._inbox = self._inbox, deque()
        for msg in inbox:
            if isinstance(msg, Arrive | ImportKV):
                reqs = msg.reqs if isinstance(msg, Arrive) else (msg.req,)
                self._requests.update((r.request_id, r) for r in reqs)
                if isinstance(msg, Arrive) and msg.verdict is not None:
                    msg.verdict.set_result(None)  # queued, and ended at once below
            elif isinstance(msg, Call):
                msg.done.set_exception(RuntimeError(ENGINE_STOPPED))
        for req in list(self._requests.values()):
            self._finish(req, "error", ENGINE_STOPPED)
        for batch in self.scheduler.pool:
            batch.close()
            for r in batch.requests:
                self.kv.free(r.block_table)
        self.scheduler.pool.clear()
        self._publish(full=True)
        self._claim(None)

    def _claim(self, thread: threading.Thread | None) -> None:
        for state in (self.scheduler, self.kv, self.answers):
            state.claim(thread)

    def _take_inbox(self) -> None:
        """Every message sent since the last boundary, in order (the engine thread's, or its owner's)."""
        with self._cv:
            inbox, self._inbox = self._inbox, deque()
        for msg in inbox:
            if isinstance(msg, Arrive):
                self._queue(msg)
            elif isinstance(msg, Cancel):
                self._cancels.append(msg.request_id)
            elif isinstance(msg, ImportKV):
                self._requests[msg.req.request_id] = msg.req
                self._imports.append((msg.req, msg.kv, msg.first))
            else:  # it sees every earlier message taken, and their snapshot published
                self._publish(full=True)
                try:
                    msg.done.set_result(msg.fn())
                except Exception as exc:  # the caller's to see
                    msg.done.set_exception(exc)

    def _queue(self, msg: Arrive) -> None:
        """Arrival events: admitted requests are queued (prefix cache looked up), refused ones forgotten."""
        refusal = self._admit(list(msg.reqs), msg.sheddable) if msg.verdict is not None else None
        if refusal is not None:
            for r in msg.reqs:
                self._unregister(r.request_id)
            msg.verdict.set_result(refusal)  # type: ignore[union-attr]
            return
        if msg.on_queued is not None:
            msg.on_queued()
        for req in msg.reqs:
            if cached := self.prefixes.cached_tokens(req):  # engine/core/prefix_cache.py
                req.num_computed_tokens = req.cached_tokens = cached
            self._requests[req.request_id] = req
            self.scheduler.on_arrival(req)
        if msg.verdict is not None:
            self._publish(added=msg.reqs)  # a streamed answer's headers report the queue with it in
            msg.verdict.set_result(None)

    def _admit(self, reqs: list[Request], sheddable: bool) -> Refusal | None:
        """Why new requests (one HTTP request's prompts and choices) are refused now, or None. Sheddable
        classes are refused when even running them all next, at the speed observed now, could not serve
        them by their class's late bound (`Request.latest`); every class when the queue is past its bound."""
        s = self.scheduler
        if len(s.waiting) + sum(len(b.requests) for b in s.pool) + len(reqs) > self.cfg.max_waiting:
            return Refusal("queue_full", "the worker's queue is full")  # counted: every request not prefilled
        if sheddable:  # requests queued together each compute what is not cached now
            spans = [SeqSpan(c, r.num_prompt_tokens - c) for r in reqs for c in [self.prefixes.cached_tokens(r)]]
            tokens = sum(span.length for span in spans)
            cost = s.cost_for(reqs)
            predicted_s = cost.batch_s(spans)
            if s.cannot_meet(reqs, predicted_s, tokens, self.clock()):
                return Refusal(SHED_REASON, _refusal_message(reqs[0], predicted_s, cost.factor(tokens),
                                                             cost.confirmed(tokens)))
        return None

    def _events_mark(self) -> tuple[int, int, int]:
        return self.scheduler.invocations, len(self.answers.running), self.kv.num_free_blocks

    def _publish_if_changed(self) -> None:
        """After an iteration: a new snapshot when an event changed the queue, or PUBLISH_EVERY_S on."""
        mark, at = self._published
        if self._events_mark() != mark or time.perf_counter() - at >= PUBLISH_EVERY_S:
            self._publish()

    def _publish(self, full: bool = False, added: Sequence[Request] = ()) -> None:
        """A new snapshot of the queue for other threads; the predicted backlog (a prediction per waiting
        request) is recomputed at most every PUBLISH_BACKLOG_S unless `full`; in between, the requests just
        `added` have their own predictions added to it."""
        s, now = self.scheduler, time.perf_counter()
        if full or now - self._backlog_at >= PUBLISH_BACKLOG_S:
            self._backlog, self._backlog_at = s.backlog(), now
        elif added:
            by_class = dict(self._backlog[1])
            for r in added:
                by_class[r.slo_class] = by_class.get(r.slo_class, 0.0) + s.predict_s(r)
            self._backlog = self._backlog[0], by_class
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

    def _iteration(self) -> None:
        self._take_inbox()
        if self._cancels:
            self._process_cancels()
        if self._imports_ready():
            self._process_imports()
        if self.scheduler.shed:
            self._process_shed()
        if self.scheduler.wake_at <= self.clock():  # the late tier's turn begins or ends
            self.scheduler.on_timer()
        batch = self.scheduler.chosen  # read before the clock: a later decision never looks negative
        now = self.clock()
        if self.answers.running and (batch is None or now >= self.answers.next_step_at):
            try:
                self._decode_step()
            except Exception as exc:
                log.exception("decode step failed")
                for stream in list(self.answers.running.values()):
                    self._finish(stream.req, "error", f"decode failed: {exc}")
                self.answers.next_step_at = float("inf")
            return
        if batch is None:
            return
        if batch is not self._current:  # the per-boundary check: is the running batch still chosen?
            self._switch(batch, now)
        try:
            finished = batch.advance()
            self._device_free_at = self.clock()
        except Exception as exc:
            log.exception("prefill step failed")
            self._fail_batch(batch, f"prefill failed: {exc}")
            return
        if finished:
            self._complete(batch)
        elif batch.exec_s - batch.observed[1] >= self.scheduler.progress_every_s:
            self.scheduler.on_progress(batch)  # the correction learns from the running batch too

    def _switch(self, batch: PrefillBatch, now: float) -> None:
        prev = self._current
        preempted = prev is not None and prev in self.scheduler.pool  # it still owes work
        if preempted:
            queued = prev.wait_device()  # on CUDA its last queued steps may still run: the stop ends there
            now = self.clock()
            prev.suspend(now, self.scheduler.chosen_at, batch, queued)
            self.preemptions += 1
            self._notify("on_segment_end", prev, now)
        if batch.began_at is None:
            waited_from = max(self._device_free_at, min(r.arrival_time for r in batch.requests))
            batch.host_gap_s = max(0.0, now - waited_from)
            self.cost.observe_host(batch.host_gap_s)  # what a batch costs the host: its predictions add it
        batch.begin_segment(now)
        self._notify("on_segment_start", batch, now)
        if preempted:
            self._notify("on_preempt", prev, batch)
        self._current = batch

    def _reserve_tokens(self, req: Request) -> int:
        """The KV a request takes when its batch forms (EngineConfig.kv_reservation): with `grow`, its
        prefill's and the next token's, whose KV the first decode step writes."""
        # (a prompt scored with max_tokens 0 writes no first token: not a block more than the prompt's)
        return req.max_total_tokens if self.cfg.kv_reservation == "full" else min(req.num_tokens + 1,
                                                                                   req.max_total_tokens)

    def _headroom_blocks(self) -> int:
        """Blocks a new batch leaves free: one per growing answer, so answers crossing into their
        next block do not evict each other the moment a batch forms."""
        return len(self.answers.running) if self.cfg.kv_reservation == "grow" else 0

    def _new_batch(self, reqs: list[Request], spans: list[SeqSpan]) -> PrefillBatch:
        spans = [self.prefixes.take(r, span) for r, span in zip(reqs, spans, strict=True)]
        for r in reqs:
            if (need := self.kv.blocks_for(self._reserve_tokens(r)) - len(r.block_table)) > 0:
                r.block_table += self.kv.allocate_blocks(need)
        return PrefillBatch.on_model(reqs, spans, self.model, self.kv, self.cost, self.budget_s)

    def _complete(self, batch: PrefillBatch) -> None:
        now = self.clock()
        batch.end_segment(now)
        self._notify("on_segment_end", batch, now)
        self.scheduler.on_progress(batch)
        for r, scored in batch.score_prompts(self.model.logits_of):  # first: one that fails is skipped below
            if isinstance(scored, Exception):
                log.error("prompt logprobs of %s failed", r.request_id, exc_info=scored)
                self._finish(r, "error", f"prompt logprobs failed: {scored}")
            else:
                r.prompt_token_logprobs = [*r.prompt_token_logprobs, *scored]
        live, unfinished = [], []
        for i, (r, whole) in enumerate(zip(batch.requests, batch.completes_prefills, strict=True)):
            r.num_computed_tokens = batch.spans[i].start + batch.spans[i].length
            if r.state.done or r.request_id not in self._requests:
                continue
            self.prefixes.prefilled(r)
            if whole and not r.sampling.max_tokens:  # a prompt scored (echo), nothing generated
                self._finish(r, "length")
            elif whole:
                live.append((i, r))
            else:  # one chunk of its prompt is done: it queues for the next
                r.state = RequestState.WAITING
                unfinished.append(r)
        logits, batch.logits = batch.logits, None
        tokens = sample(logits[[i for i, _ in live]], [r for _, r in live], self._generators,
                        self.tokenizer.eos_token_ids) if live else []
        now = self.clock()
        for (_, r), token in zip(live, tokens, strict=True):
            if isinstance(token, Exception):
                self._finish(r, "error", f"sampling failed: {token}")
                continue
            if r.kv_sink is not None:  # hand-off: copy the prompt's KV out before the blocks can be freed
                r.kv_sink(self.kv.export_tokens(r.block_table, r.num_prompt_tokens))
            self._start_decoding(r, token, now)
        for r in batch.requests:  # cancelled while the batch ran: their KV was in use until now
            if r.state.done:
                self.kv.free(r.block_table)  # on_completion below decides anyway
        self.scheduler.on_completion(batch, unfinished)
        self._current = None
        self.answers.schedule(now)

    def _start_decoding(self, r: Request, token: Sampled, now: float) -> None:
        """Its first token, or after a recompute its next one (the gap includes the eviction)."""
        gap = now - r.last_token_time if r.last_token_time is not None else None
        out = self.answers.start(r, token, now)
        self._notify("on_tokens", [r], [gap])
        self._emit(out)

    def _evict(self, evicted: list[Request]) -> None:
        """Answers.make_room took these answers' KV back: they queue to be recomputed. Each one's next
        token is due a TBT target after its recompute, were it to run now: the deadline its slack is
        ranked by, so it starts feasible and grows urgent as it waits (a bare TBT target would rank
        a long recompute hopeless at once, behind every feasible prompt, for as long as they come)."""
        now = self.clock()
        for req in evicted:
            # a handed-off request's prompt was never looked up here (block_hashes None): recomputed whole
            req.num_computed_tokens = self.prefixes.cached_tokens(req) if req.block_hashes is not None else 0
            req.state = RequestState.WAITING
            req.deadline = now + self.scheduler.predict_s(req) + req.tbt_target_s
            req.evictions += 1
            self._notify("on_evict", req, now)
            self.scheduler.on_evicted(req)

    def _give_back(self, req: Request) -> None:
        self.prefixes.answered(req)  # what it wrote stays findable for its recompute
        self.kv.free(req.block_table)

    def _imports_ready(self) -> bool:
        """Whether the next handed-off request can be taken in: it waits, first in first out, while the
        KV blocks its answer needs are held by the answers running here (a failure instead would
        turn a busy decode worker into one that answers 500)."""
        while self._imports and self._imports[0][0].request_id not in self._requests:
            self._imports.popleft()  # cancelled while it waited
        return bool(self._imports) and (
            self.kv.blocks_for(self._reserve_tokens(self._imports[0][0])) <= self.kv.num_free_blocks)

    def _process_imports(self) -> None:
        while self._imports_ready():
            req, kv, token = self._imports.popleft()
            try:
                req.block_table = self.kv.allocate(self._reserve_tokens(req))
            except OutOfBlocks as exc:  # not expected: its blocks were free a moment ago
                self._finish(req, "error", f"KV cache full: {exc}")
                continue
            self.kv.import_tokens(req.block_table, kv)
            req.num_computed_tokens = req.num_prompt_tokens
            req.prefill_start = self.clock()
            self._start_decoding(req, token, self.clock())
            self.answers.schedule(self.clock())

    def _decode_step(self) -> None:
        if evicted := self.answers.make_room(self._give_back):
            self._evict(evicted)
        if not self.answers.running:  # every answer was evicted
            return
        streams, tokens = self.answers.step(self.model, self.kv, self._generators)
        now = self._device_free_at = self.clock()
        got = [(s.req, now - s.req.last_token_time) for s, t in zip(streams, tokens, strict=True)
               if not isinstance(t, Exception)]
        self._notify("on_tokens", [r for r, _ in got], [gap for _, gap in got])
        for stream, token in zip(streams, tokens, strict=True):
            if isinstance(token, Exception):
                self._finish(stream.req, "error", f"sampling failed: {token}")
                continue
            stream.req.last_token_time = now
            self._emit(stream.push(token))
        self.answers.next_step_at = float("inf")
        self.answers.schedule(now)

    def _emit(self, out: TokenOutput) -> None:
        req = self._requests.get(out.request_id)
        if req is None:
            return
        if out.finish_reason:
            # Free before telling the client: once it has its answer, the KV must be back.
            self._release(req, out.finish_reason)
        if req.sink is not None:
            try:
                req.sink(out)
            except Exception:
                log.exception("output sink of %s failed", req.request_id)

    def _release(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = self.clock()
        req.state = {"cancelled": RequestState.CANCELLED, "error": RequestState.FAILED}.get(
            reason, RequestState.FINISHED)
        self.answers.drop(req.request_id)
        self._generators.pop(req.request_id, None)
        self._requests.pop(req.request_id, None)
        self._unregister(req.request_id)
        if not self._in_running_batch(req):
            if reason in ("stop", "length"):
                self.prefixes.answered(req)
            self._free_blocks(req.block_table)
        self._notify("on_finish", req)
        self._publish()  # before its client hears of it: what it reads then counts it gone

    def _notify(self, event: str, *args: object) -> None:
        """Tell the observers (telemetry). They watch, never steer: one that raises is logged, and
        no request fails for it."""
        for o in self.observers:
            try:
                getattr(o, event)(*args)
            except Exception:
                log.exception("observer %s failed on %s", type(o).__name__, event)

    def _free_blocks(self, block_table: list[int]) -> None:
        """Return KV blocks; requests that waited for them get a scheduling decision (a completion
        event), or they would wait for the next arrival."""
        if not block_table:
            return
        self.kv.free(block_table)
        if self.scheduler.waiting and self.scheduler.chosen is None:
            self.scheduler.on_kv_freed()

    def _in_running_batch(self, req: Request) -> bool:
        """KV of a request inside a batch that goes on is still being written: free it at completion."""
        return any(req in b.requests for b in self.scheduler.pool)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        self._emit(TokenOutput(req.request_id, [], "", reason, error))

    def _process_shed(self) -> None:
        """Queued requests the scheduler shed (late, of a `late = "shed"` class): each ends with the
        error the worker answers as a refusal (429, Retry-After; engine/protocol/slo.py)."""
        shed, self.scheduler.shed = self.scheduler.shed, []
        for req in shed:
            self._finish(req, "error", SHED_ERROR)

    def _process_cancels(self) -> None:
        while self._cancels:
            req = self._requests.get(self._cancels.popleft())
            if req is None:
                continue
            dropped = self.scheduler.on_cancel(req)
            if dropped is not None:
                dropped.close()
                if dropped is self._current:
                    self._current = None
            if dropped is not None:
                for r in dropped.requests:
                    if r is not req:
                        self._free_blocks(r.block_table)
            self._finish(req, "cancelled")

    def _fail_batch(self, batch: PrefillBatch, message: str) -> None:
        if batch in self.scheduler.pool:
            self.scheduler.on_completion(batch)
        batch.close()
        if self._current is batch:
            self._current = None
        for r in batch.requests:
            if not r.state.done:
                self._finish(r, "error", message)
            self.kv.free(r.block_table)

    def _fail_current(self, message: str) -> None:
        if self._current is not None:
            self._fail_batch(self._current, message)


def release_memory() -> None:
    """After the last reference to an Engine is dropped (`del engine`): its weights and KV cache (an 8B
    model's take 50 GB of a GPU with the default cache) are freed only by a collection, as the engine
    holds itself (its thread's target, the scheduler's bound methods)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
