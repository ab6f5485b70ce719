"""The gateway's routing, driving a simulated fleet (engine/sim/fleet.py's `Router`).

The simulated instances are `gateway.routing.Worker`s in a real `WorkerPool`: a request is placed by the
pool's own `acquire` (least predicted backlog plus the gateway's own requests in flight, round robin
among equals, prefix affinity within its slack), released as the gateway releases it, its prefix
recorded where it was admitted (`Forwarder._answer`), and the pool's view of each instance's load is
refreshed every `poll_s` of virtual time with what that instance's GET /load would say (the fields
`WorkerPool._probe_load` sets from it). Nothing of the ranking is re-implemented here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from engine.core.request import Request
from engine.sim.fleet import Load
from gateway.affinity import CHARS_PER_TOKEN, CHUNK_CHARS, Prefix, prefix_key
from gateway.config import GatewayConfig
from gateway.routing import Worker, WorkerPool

KeyOf = Callable[[Request], Prefix | None]
DEFAULTS = GatewayConfig()


def prompt_key(chars: int = DEFAULTS.prefix_affinity_chars) -> KeyOf:
    """The key the gateway computes from a request's body: its prompt's token ids (for simulated
    requests that carry the very prompts a real gateway was sent)."""
    return lambda r: prefix_key({"prompt": r.prompt_token_ids}, chars)


def distinct_key(chars: int = DEFAULTS.prefix_affinity_chars) -> KeyOf:
    """A trace of token counts only: every prompt is its own (no two share a prefix), so a prompt long
    enough for a key goes to that key's rendezvous choice, unless load wins, as the gateway sends a new
    prompt. (Hashing a stand-in text of the prompt's length would cost ~1 us per 256 characters.)"""
    need = -(-chars // CHARS_PER_TOKEN)

    def key(r: Request) -> Prefix | None:
        if chars <= 0 or r.num_prompt_tokens < need:
            return None
        return Prefix(hashlib.blake2b(r.request_id.encode(), digest_size=16).digest(), [], -(-chars // CHUNK_CHARS))

    return key


def trace_key(chars: int = DEFAULTS.prefix_affinity_chars, block_tokens: int = 512) -> KeyOf:
    """A trace that names its prompts' blocks (`Request.block_hashes`, Mooncake's hash ids, each a hash
    of its block and all before it): they are the prefix's chunks, as the gateway's chained hashes of
    its text are, in blocks of `block_tokens` instead of CHUNK_CHARS characters; a request without
    them is a distinct prompt."""
    distinct = distinct_key(chars)
    need_tokens = -(-chars // CHARS_PER_TOKEN)
    need_blocks = max(1, -(-need_tokens // block_tokens))

    def key(r: Request) -> Prefix | None:
        hashes = r.block_hashes
        if not hashes:
            return distinct(r)
        if chars <= 0 or r.num_prompt_tokens < need_tokens or len(hashes) < need_blocks:
            return None
        return Prefix(hashlib.blake2b(b"".join(hashes[:need_blocks]), digest_size=16).digest(), list(hashes),
                      need_blocks)

    return key


def _backlog_s(load: Load) -> float:
    """A load's predicted backlog as GET /load and a worker's answers say it (`Engine.load`)."""
    formed, by_class = load
    return formed + sum(by_class.values())


def _at_once(step: Coroutine[Any, Any, Worker | None]) -> Worker | None:
    """Run a coroutine that never waits (a pool in front of flowprefill workers does not queue)."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    step.close()
    raise RuntimeError("the pool queued the request: gated pools (plain OpenAI upstreams) are not simulated")


class GatewayRouter:
    """`n` simulated instances as one gateway's worker pool. `urls`: the workers' names (rendezvous
    hashes them: the real fleet's URLs give the real homes); `key_of`: a request's prefix key (None: no
    affinity); `first_poll_s`: when the pool first reads the instances' loads, then every `poll_s`.

    A real gateway's polls fall anywhere against a trace's bursts, and where they fall decides how a
    burst is shared: between two polls every request goes to the instance the last one saw least
    loaded, until its requests in flight outweigh the difference. Two `flowprefill` workers at 16 req/s
    (azure-mix, 200 requests, the runs' own speed) met 37.8-53.6 of their 63 `standard` requests as the
    first poll moved from 0 to 0.75 s; the planner spreads its draws over it (`Planner`)."""

    def __init__(self, n: int, key_of: KeyOf | None = None, poll_s: float = 1.0,
                 slack_s: float = DEFAULTS.prefix_affinity_slack_s, urls: Sequence[str] | None = None,
                 first_poll_s: float = 0.0) -> None:
        urls = list(urls or [f"http://instance-{i}" for i in range(n)])
        if len(urls) != n:
            raise ValueError(f"{n} instances but {len(urls)} URLs")
        # No HTTP here: the pool's client is for its health checks, which the simulation stands in for.
        self.pool = WorkerPool(urls, None, poll_s=poll_s, affinity_slack_s=slack_s)  # type: ignore[arg-type]
        self.index = {w.url: i for i, w in enumerate(self.pool.workers)}
        self.key_of, self.poll_s = key_of, poll_s
        self._next_poll = first_poll_s
        self._keys: dict[str, Prefix | None] = {}
        self.matched_chars = 0  # prefix affinity's finds, summed

    def pick(self, req: Request, now: float, tried: set[int]) -> int | None:
        if req.request_id not in self._keys:  # (a request shed elsewhere keeps its key)
            self._keys[req.request_id] = self.key_of(req) if self.key_of is not None else None
        key = self._keys[req.request_id]
        workers = self.pool.workers
        w = _at_once(self.pool.acquire(req.deadline, {workers[i].url for i in tried}, key))
        return None if w is None else self.index[w.url]

    def shed(self, req: Request, instance: int) -> None:
        self.pool.release(self.pool.workers[instance])

    def admitted(self, req: Request, instance: int) -> None:
        key = self._keys.pop(req.request_id, None)
        if key is not None:
            self.matched_chars += key.matched_chars
            self.pool.prefixes.record(key, self.pool.workers[instance].url)  # its prompt is cached there now

    def finished(self, req: Request, instance: int) -> None:
        self.pool.release(self.pool.workers[instance])

    def reported(self, instance: int, load: Load) -> None:
        """What the instance's answer reports once it admitted a request (`Forwarder._answer`)."""
        self.pool.reported(self.pool.workers[instance], _backlog_s(load))

    def poll_at(self) -> float:
        return self._next_poll

    def poll(self, now: float, loads: Sequence[Load]) -> None:
        for w, load in zip(self.pool.workers, loads, strict=True):
            w.backlog_s = _backlog_s(load)  # predicted_backlog_s
            w.backlog_by_class = load[1]  # predicted_backlog_by_class_s
        self._next_poll = now + self.poll_s
