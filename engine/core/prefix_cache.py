"""Automatic prefix caching, the engine's side: when a request looks its prompt up, takes the blocks
found, and makes the blocks it wrote findable. The block pool (engine/core/kv_cache.py) keeps the
references, the content hashes and the eviction order.

A request looks its prompt's full blocks up at arrival, up to the block holding its last token
(whose logits the first output token needs), and is queued with the tokens found as already
computed, so the scheduler predicts and ranks the shorter prefill. It takes the blocks (a reference
each) only when its batch forms: a waiting request holds nothing, so once the running work is done
the first in line always fits. A prefill makes the prompt blocks it wrote findable; a finished
answer its own, for the conversation's next turn.
"""

from __future__ import annotations

from engine.core.kv_cache import BlockPool, block_hashes
from engine.core.request import Request
from engine.model.cost import SeqSpan


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool) -> None:
        self.pool, self.enabled = pool, enabled

    def hash_prompt(self, req: Request) -> None:
        """Its prompt's block hashes, computed once (on the submitting thread: the pool is not read)."""
        if self.enabled:
            self._matchable(req)

    def _matchable(self, req: Request) -> list[bytes]:
        if req.block_hashes is None:
            req.block_hashes = block_hashes(req.prompt_token_ids, self.pool.block_size)
        return req.block_hashes[: (req.num_tokens - 1) // self.pool.block_size]

    def cached_tokens(self, req: Request) -> int:
        """How many of its prompt's tokens are cached now (reserves nothing)."""
        if not self.enabled or req.block_table:
            return 0
        hashes = self._matchable(req)  # hashed even when unused: what it writes is cached for others
        if req.sampling.prompt_logprobs is not None and not req.output_token_ids:
            return 0  # prompt logprobs need every position computed
        return self.pool.cached_prefix(hashes) * self.pool.block_size

    def take(self, req: Request, span: SeqSpan) -> SeqSpan:
        """When its batch forms: a reference on each block found at arrival (the span starts after
        them). A block evicted since is computed too: the returned span starts where what is still
        cached ends."""
        if req.block_table or not span.start:
            return span
        req.block_table = self.pool.acquire_prefix(self._matchable(req)[: span.start // self.pool.block_size])
        got = len(req.block_table) * self.pool.block_size
        if got < span.start:
            span = SeqSpan(got, span.start + span.length - got)
            req.num_computed_tokens = got
            if not req.output_token_ids:  # usage reports the prompt's cached tokens, not a recompute's
                req.cached_tokens = got
        return span

    def prefilled(self, req: Request) -> None:
        """Its prompt's blocks written so far are findable from now on."""
        if req.block_hashes is not None:
            self.pool.register(req.block_table, req.block_hashes[: req.num_computed_tokens // self.pool.block_size])

    def answered(self, req: Request) -> None:
        """An answer's blocks are findable too: a finished one's for the conversation's next turn,
        an evicted one's for its own recompute. Its last token's KV was never written (it was
        sampled, not fed back)."""
        if req.block_hashes is not None and req.block_table:
            written = [*req.prompt_token_ids, *req.output_token_ids[:-1]]
            req.block_hashes = block_hashes(written, self.pool.block_size, req.block_hashes)
            self.pool.register(req.block_table, req.block_hashes)
