"""What the gateway's gate in front of plain OpenAI servers does with a request that can no longer
meet its deadline while it waits there: the engine's slack and late tier (engine/core/scheduler), as far as
a gateway can see them.

Plain EDF serves the request with the earliest deadline first, and under overload that is the one
already late: each hopeless request served first makes the next one late too (EDF's domino effect),
and every class misses. The engine decides a request is hopeless when its predicted slack turns
negative. The gateway has no cost model of the server behind it, but it sees how long the server took
from dispatch to first token for the prompts it sent (`ServiceTimes`, by prompt size): a waiter's
*latest start* is its deadline less that time, waiters go in that order (slack-based EDF), and once
its latest start has passed while it still waits (its deadline itself, before anything is seen), as
the request's SLO class says (`late`):

- `serve`: it keeps its place by its *late bound* (deadline + `late_bound_ms`, twice the target by
  default) instead: requests that can still make theirs go first, and it goes once its bound is the
  earliest, so it is served within about that bound rather than never;
- `shed` (sheddable classes): it is refused at once, 429 with Retry-After and the reason, as the
  engine refuses a request that turned hopeless while queued, rather than spending the server on an
  answer that is already late.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from typing import Any, NamedTuple


class Lateness(NamedTuple):
    """A waiter's class's late policy: how long past its deadline it may be served, or shed."""

    bound_s: float
    shed: bool


class LateShed(Exception):
    """A sheddable request could no longer meet its deadline while it waited at the gateway."""


class LateGate:
    """The waiters' late policies, and the re-keying of the gate's heap as deadlines pass."""

    def __init__(self) -> None:
        self._policy: dict[asyncio.Future[Any], tuple[float, Lateness]] = {}
        self.late = 0  # waiters re-keyed to their late bound, since start
        self.shed = 0  # waiters shed, since start
        self._rekeyed: set[asyncio.Future[Any]] = set()  # waiting on their late bound now

    def track(self, fut: asyncio.Future[Any], deadline: float, late: Lateness | None) -> None:
        """Watch a waiter until it is served, leaves, or turns late (then it needs watching no more)."""
        if late is not None:
            self._policy[fut] = (deadline, late)
            fut.add_done_callback(lambda done: self._policy.pop(done, None))

    def is_late(self, fut: asyncio.Future[Any]) -> bool:
        """Is this waiter waiting on its late bound (its latest start passed)?"""
        return fut in self._rekeyed

    def rekey(self, waiting: list[Any], now: float) -> list[Any]:
        """`waiting` (a heap of (latest start, seq, ..., fut)) with every waiter whose latest start has
        passed moved to its late bound, or shed; the same list when none is due (the common case: one
        look at the earliest key)."""
        if not waiting or waiting[0][0] > now:
            return waiting
        out, changed = [], False
        for item in waiting:
            fut = item[-1]
            if item[0] > now or fut.done() or (policy := self._policy.pop(fut, None)) is None:
                out.append(item)  # on time, gone, untracked, or already on its late bound
                continue
            changed = True
            deadline, late = policy
            if late.shed:
                self.shed += 1
                fut.set_exception(LateShed())
                continue
            self.late += 1
            self._rekeyed.add(fut)
            fut.add_done_callback(self._rekeyed.discard)
            out.append((deadline + late.bound_s, *item[1:]))
        if changed:
            heapq.heapify(out)
        return out


class ServiceTimes:
    """How long the servers behind the gate took from dispatch to first token, by prompt size (powers
    of two of its tokens): the cost a waiter's slack is judged by. Each size's estimate is a low
    quantile of its last `WINDOW` streamed requests, so a waiter is called hopeless only where the
    server was rarely faster; a size with fewer than `MIN_SEEN` answers borrows the largest estimate
    of the shorter sizes (a longer prompt takes at least as long), and none at all is no cost (plain
    deadlines, as before anything is seen). The window forgets a slower or faster server within
    `WINDOW` answers of a size (a size that stops arriving keeps its last estimate until it returns)."""

    WINDOW = 64
    MIN_SEEN = 8
    QUANTILE = 0.25
    HIGH_QUANTILE = 0.9  # what a request is expected back by, for backfilling (gateway/routing.py)

    def __init__(self) -> None:
        self._seen: dict[int, deque[float]] = {}
        self._estimate: dict[tuple[int, float], float] = {}  # by (size, quantile), until another answer

    @staticmethod
    def size(tokens: int) -> int:
        """The size class of a prompt of `tokens` tokens: 1 for 1, 2 for 2-3, 3 for 4-7, ..."""
        return max(tokens, 1).bit_length()

    def observe(self, tokens: int, seconds: float) -> None:
        """A request of `tokens` prompt tokens had its first token `seconds` after it was dispatched. A
        prompt of no countable tokens (an image only, text estimated at none) tells nothing of its size."""
        if tokens < 1:
            return
        size = self.size(tokens)
        self._seen.setdefault(size, deque(maxlen=self.WINDOW)).append(max(seconds, 0.0))
        self._estimate.clear()  # a size's estimate reads the shorter sizes' too

    def estimate(self, tokens: int, quantile: float = QUANTILE) -> float:
        """Seconds from dispatch to first token that a prompt of `tokens` tokens should expect at least
        (at the default quantile; a higher one: what it should be back by)."""
        size = self.size(tokens)
        if (cached := self._estimate.get((size, quantile))) is None:
            own = self._seen.get(size)
            if own is not None and len(own) >= self.MIN_SEEN:
                cached = self._quantile(own, quantile)
            else:
                cached = max((self._quantile(seen, quantile) for s, seen in self._seen.items()
                              if s < size and len(seen) >= self.MIN_SEEN), default=0.0)
            self._estimate[(size, quantile)] = cached
        return cached

    def estimates(self) -> dict[int, float]:
        """Each size seen often enough, as its largest prompt (2**size - 1 tokens), and its estimate."""
        return {2 ** size - 1: self.estimate(2 ** size - 1) for size, seen in sorted(self._seen.items())
                if len(seen) >= self.MIN_SEEN}

    @staticmethod
    def _quantile(seen: deque[float], quantile: float) -> float:
        ordered = sorted(seen)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]
