"""The engine: one thread that executes the scheduler's chosen prefill batch operator by operator,
interleaves decode steps at operator boundaries, and streams tokens back. Its loop and batches are here;
what other threads send it and read of it is engine/core/front.py, what it does with results
engine/core/outputs.py (the parts of one `Engine`, as SGLang's scheduler is split in mixins)."""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from engine.core.config import EngineConfig, auto_kv_tokens, kv_bytes_per_token
from engine.core.cpu_affinity import CorePinning, on_passing_thread, team_ids
from engine.core.decode import Answers
from engine.core.front import EngineFront
from engine.core.kv_cache import KVCache, reserved_tokens
from engine.core.messages import ENGINE_STOPPED, Arrive, Call, Cancel, EngineSnapshot, ImportKV, Message, Refusal
from engine.core.observer import EngineObserver
from engine.core.outputs import EngineOutputs
from engine.core.prefill import PrefillBatch, PrefillLoop
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request, Sampled
from engine.core.scheduler import UNCONFIRMED_SPEEDUP, Policy, Scheduler, make_policy
from engine.core.thread_cpu import ThreadCPU, readable
from engine.model import load_model, use_device
from engine.model.calibration import StoredProfile, load_cost, stored_cost
from engine.model.cost import ATTN_IN, FFN, MLP, SeqSpan
from engine.protocol.slo import SHED_REASON
from engine.protocol.worker import WorkerLoad

log = logging.getLogger("flowprefill.engine")


def _refusal_message(req: Request, predicted_s: float, factor: float, confirmed: bool) -> str:
    by = (f"its {req.ttft_target_s * 1000:g} ms TTFT target" if req.shed_late else
          f"{req.late_s * 1000:g} ms past its {req.ttft_target_s * 1000:g} ms TTFT target (its class's late bound)")
    speed = (f"at the speed observed now, {factor:.2f}x the calibrated time" if confirmed else
             f"calibration alone, no batch of its size has run yet; refused only as it misses even "
             f"{UNCONFIRMED_SPEEDUP:g}x faster")
    return (f"the request cannot be served even {by} here: its prefill alone is predicted to take "
            f"{predicted_s:.2f} s ({speed}); retry later or with a looser class")


class Engine(EngineFront, EngineOutputs):
    def __init__(self, cfg: EngineConfig | None = None, policy: str | Policy = "flowprefill",
                 clock: Callable[[], float] = time.monotonic, record_profile: bool = True,
                 profile: StoredProfile | None = None) -> None:
        """`record_profile=False`: read the cached cost profile without adding a calibration to it
        (a simulator's probe, engine/model/calibration.py's `load_cost`). `profile`: predict with the profile
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
        self.prefill = PrefillLoop(self.scheduler, clock, self._notify)
        self._cv = threading.Condition()  # guards the inbox and `_stop`: all other state is the engine thread's
        self._inbox: deque[Message] = deque()
        self._ids: set[str] = set()  # ids in use, from submission to the last output (`has_request`)
        self._ids_lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._cancels: deque[str] = deque()
        self._imports: deque[tuple[Request, dict[str, torch.Tensor], Sampled]] = deque()
        self._stop = False
        self.thread_cpu: ThreadCPU | None = None  # its compute threads' CPU and the serving side's, once running
        self._backlog: tuple[float, dict[str, float]] = (0.0, {})
        self._backlog_at = -math.inf
        self._backlog_key: tuple[int, int, int, int] = (-1, -1, -1, -1)  # front.py's `_publish`
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
        self.model, self.tokenizer = load_model(cfg, self.pinning.before if self.pinning is not None else None)
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
        batch = self.scheduler.chosen
        if self.answers.running and (batch is None or self.clock() >= self.answers.next_step_at):
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
        self.prefill.switch(batch)  # outside the try: a failure here is the running batch's (`_fail_current`)
        try:
            finished = self.prefill.step(batch)  # engine/core/prefill.py
        except Exception as exc:
            log.exception("prefill step failed")
            self._fail_batch(batch, f"prefill failed: {exc}")
            return
        if finished:
            self._complete(batch)

    @property
    def preemptions(self) -> int:
        return self.prefill.preemptions

    def _reserve_tokens(self, req: Request) -> int:
        return reserved_tokens(req, self.cfg.kv_reservation)

    def _headroom_blocks(self) -> int:
        """Blocks a new batch leaves free: one per growing answer, so answers crossing into their
        next block do not evict each other the moment a batch forms."""
        return len(self.answers.running) if self.cfg.kv_reservation == "grow" else 0

    def _new_batch(self, reqs: list[Request], spans: list[SeqSpan]) -> PrefillBatch:
        spans = [self.prefixes.take(r, span) for r, span in zip(reqs, spans, strict=True)]
        for r in reqs:
            self.kv.reserve(r.block_table, self._reserve_tokens(r))
        return PrefillBatch.on_model(reqs, spans, self.model, self.kv, self.cost, self.budget_s)


def release_memory() -> None:
    """After the last reference to an Engine is dropped (`del engine`): its weights and KV cache (an 8B
    model's take 50 GB of a GPU with the default cache) are freed only by a collection, as the engine
    holds itself (its thread's target, the scheduler's bound methods)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
