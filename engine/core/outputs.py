"""What the engine thread does with results: a finished batch's first tokens, decode steps, answers' ends,
cancellations, failures, and the KV each gives back (a part of `Engine`)."""

from __future__ import annotations

import logging

from engine.core.kv_cache import OutOfBlocks
from engine.core.prefill import PrefillBatch
from engine.core.request import Request, RequestState, Sampled, TokenOutput
from engine.core.sampling import sample
from engine.protocol.slo import SHED_ERROR

log = logging.getLogger("flowprefill.engine")


class EngineOutputs:
    """Results out of the engine thread (a part of `Engine`)."""

    def _complete(self, batch: PrefillBatch) -> None:
        self.prefill.end(batch)  # engine/core/prefill.py
        for r, scored in batch.score_prompts(self.model.logits_of):  # first: one that fails is skipped below
            if isinstance(scored, Exception):
                log.error("prompt logprobs of %s failed", r.request_id, exc_info=scored)
                self._finish(r, "error", f"prompt logprobs failed: {scored}")
            else:
                r.prompt_token_logprobs = [*r.prompt_token_logprobs, *scored]
        live, unfinished = [], []
        for i, (r, whole) in enumerate(zip(batch.requests, batch.completes_prefills, strict=True)):
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
        self.prefill.complete(batch, unfinished)
        self.answers.schedule(now)

    def _start_decoding(self, r: Request, token: Sampled, now: float) -> None:
        """Its first token, or after a recompute its next one (the gap includes the eviction)."""
        gap = now - r.times.last_token_time if r.times.last_token_time is not None else None
        out = self.answers.start(r, token, now)
        self._notify("on_tokens", [r], [gap])
        self._emit(out)

    def _evict(self, evicted: list[Request]) -> None:
        """Answers.make_room took these answers' KV back: they queue to be recomputed
        (`Scheduler.on_evicted`), what of them is still cached kept."""
        now = self.clock()
        for req in evicted:
            # a handed-off request's prompt was never looked up here (block_hashes None): recomputed whole
            req.num_computed_tokens = self.prefixes.cached_tokens(req) if req.block_hashes is not None else 0
            self._notify("on_evict", req, now)  # before a decision can take its cached blocks
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
            req.times.prefill_start = self.clock()
            self._start_decoding(req, token, self.clock())
            self.answers.schedule(self.clock())

    def _decode_step(self) -> None:
        if evicted := self.answers.make_room(self._give_back):
            self._evict(evicted)
        if not self.answers.running:  # every answer was evicted
            return
        streams, tokens = self.answers.step(self.model, self.kv, self._generators)
        now = self.prefill.device_free_at = self.clock()
        got = [(s.req, now - s.req.times.last_token_time) for s, t in zip(streams, tokens, strict=True)
               if not isinstance(t, Exception)]
        self._notify("on_tokens", [r for r, _ in got], [gap for _, gap in got])
        for stream, token in zip(streams, tokens, strict=True):
            if isinstance(token, Exception):
                self._finish(stream.req, "error", f"sampling failed: {token}")
                continue
            stream.req.times.last_token_time = now
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
        req.times.finish_time = self.clock()
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
                self.prefill.dropped(dropped)
            if dropped is not None:
                for r in dropped.requests:
                    if r is not req:
                        self._free_blocks(r.block_table)
            self._finish(req, "cancelled")

    def _fail_batch(self, batch: PrefillBatch, message: str) -> None:
        if batch in self.scheduler.pool:
            self.scheduler.on_completion(batch)
        batch.close()
        self.prefill.dropped(batch)
        for r in batch.requests:
            if not r.state.done:
                self._finish(r, "error", message)
            self.kv.free(r.block_table)

    def _fail_current(self, message: str) -> None:
        if self.prefill.current is not None:
            self._fail_batch(self.prefill.current, message)
