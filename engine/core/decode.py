"""Decode-side bookkeeping: streaming text, stop strings, EOS and length limits, and the KV the
answers grow into."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.kv_cache import BlockPool, KVCache
from engine.core.owner import Owned, owned
from engine.core.request import Request, RequestState, Sampled, TokenOutput
from engine.core.sampling import sample
from engine.core.text import prefix_overlap
from engine.core.tokenizer import ByteTokenizer, HFTokenizer
from engine.model.llama import LlamaModel


class OutputStream:
    """Turns a request's sampled tokens into text deltas and decides when it is finished.

    Text that might be the start of a stop string is held back until it is known not to be one,
    so a streamed response never shows a stop string (as OpenAI's API behaves)."""

    def __init__(self, req: Request, tokenizer: ByteTokenizer | HFTokenizer) -> None:
        self.req = req
        self.eos = set() if req.sampling.ignore_eos else set(tokenizer.eos_token_ids)
        self._decoder = tokenizer.incremental_decoder()
        self._pending = ""  # decoded text not yet sent
        self._check_from = 0  # where in it stop strings may end (before: the first min_tokens tokens')

    def push(self, sampled: Sampled) -> TokenOutput:
        req, token, p = self.req, sampled.token, self.req.sampling
        req.output_token_ids.append(token)
        finish, piece = None, ""
        if token in self.eos:
            finish = "stop"
        elif token in p.stop_token_ids:  # as vLLM: its text only with include_stop_str_in_output
            finish = "stop"
            if p.include_stop_str_in_output:
                self._pending += self._decoder.push(token)
        else:
            piece = self._decoder.push(token)
            self._pending += piece
        if req.constraint is not None:
            try:
                if req.constraint.accept(token, piece):
                    finish = "stop"  # the constraint is complete: only the end could follow
            except ValueError as exc:  # not expected: the sampler only offers what the constraint allows
                return TokenOutput(req.request_id, [token], "", "error", str(exc))
        # As vLLM: the text of the first min_tokens tokens is never searched for stop strings (one
        # may begin in its last characters and end after); the sampler holds EOS and stop ids back.
        if len(req.output_token_ids) <= p.min_tokens:
            self._check_from = len(self._pending)
        else:
            found = [(i, len(s)) for s in p.stop
                     if (i := self._pending.find(s, max(0, self._check_from - len(s) + 1))) >= 0]
            if found:
                at, n = min(found)
                self._pending, finish = self._pending[:at + n * p.include_stop_str_in_output], "stop"
        if finish is None and len(req.output_token_ids) >= p.max_tokens:
            finish = "length"
        if finish:
            text, self._pending = self._pending, ""
        else:
            hold = max((prefix_overlap(self._pending, s) for s in p.stop), default=0)
            text, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold :]
        self._check_from = max(0, self._check_from - len(text))
        return TokenOutput(req.request_id, [token], text, finish,
                           logprobs=None if sampled.logprob is None else [sampled.logprob])


# A decode step runs when the most urgent answer has used this share of its TBT target, so prefill
# keeps the device between decode steps and TBT holds (a prefill step is bounded).
DECODE_TBT_SHARE = 0.5


class Answers(Owned):
    """The answers being generated (`running`), and those evicted until their recompute.

    KV for an answer is taken as it grows, a block at a time. When blocks run out, the least
    important answer (lowest priority, then latest arrival) is evicted: its blocks go back and it
    queues to be prefilled again with its answer so far (vLLM's preemption by recompute). Its
    written blocks stay findable in the prefix cache, so unless they were reused meanwhile the
    recompute is mostly a cache hit. Its stream, with any text held back, waits here meanwhile."""

    def __init__(self, kv: BlockPool, tokenizer: ByteTokenizer | HFTokenizer) -> None:
        self.kv, self.tokenizer = kv, tokenizer
        self.running: dict[str, OutputStream] = {}
        self.evicted: dict[str, OutputStream] = {}
        self.next_step_at = float("inf")  # when the next decode step is due (see DECODE_TBT_SHARE)

    def schedule(self, now: float) -> None:
        if self.running:
            tbt = min(s.req.tbt_target_s for s in self.running.values())
            self.next_step_at = min(self.next_step_at, now + DECODE_TBT_SHARE * tbt)

    @owned
    def step(self, model: LlamaModel, kv: KVCache, generators: dict[str, torch.Generator]
             ) -> tuple[list[OutputStream], list[Sampled | Exception]]:
        """One decode step of every running answer (continuous batching): each one's next token."""
        streams = list(self.running.values())
        reqs = [s.req for s in streams]
        logits = model.decode([r.output_token_ids[-1] for r in reqs], [r.num_tokens - 1 for r in reqs],
                              [r.block_table for r in reqs], kv)
        return streams, sample(logits, reqs, generators, self.tokenizer.eos_token_ids)

    @owned
    def start(self, req: Request, token: Sampled, now: float) -> TokenOutput:
        """Its prefill is done: its first token, or after a recompute its next one."""
        stream = self.evicted.pop(req.request_id, None)
        if stream is None:
            stream = OutputStream(req, self.tokenizer)
            req.times.first_token_time = now
        req.times.last_token_time = now
        req.state = RequestState.DECODING
        self.running[req.request_id] = stream
        return stream.push(token)

    @owned
    def make_room(self, release: Callable[[Request], None]) -> list[Request]:
        """Give each running answer the block its next token's KV goes into, evicting answers
        (`release` gives their blocks back) while too few are free. Returns the evicted, to be
        queued only now: queued at once, a batch could have taken the blocks they gave back."""
        short = {rid: need for rid, s in self.running.items()
                 if (need := self.kv.blocks_for(s.req.num_tokens) - len(s.req.block_table)) > 0}
        evicted: list[Request] = []
        while short and sum(short.values()) > self.kv.num_free_blocks:
            victim = min(self.running.values(), key=lambda s: (s.req.priority, -s.req.arrival_time)).req
            short.pop(victim.request_id, None)
            self.evicted[victim.request_id] = self.running.pop(victim.request_id)
            release(victim)
            evicted.append(victim)
        for rid, need in short.items():
            self.running[rid].req.block_table += self.kv.allocate_blocks(need)
        return evicted

    @owned
    def drop(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        self.evicted.pop(request_id, None)
