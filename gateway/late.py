"""What the gateway's EDF gate in front of plain OpenAI servers does with a request whose deadline
passed while it waited there: the engine's late tier (engine/scheduler), as far as a gateway can see it.

Plain EDF serves the request with the earliest deadline first, and under overload that is the one
already late: each hopeless request served first makes the next one late too (EDF's domino effect),
and every class misses. The engine decides a request is hopeless when its predicted slack turns
negative; the gateway has no cost model of the server behind it, so it decides when the deadline
itself passes while the request still waits. Then, as the request's SLO class says (`late`):

- `serve`: it keeps its place by its *late bound* (deadline + `late_bound_ms`, twice the target by
  default) instead of its deadline: requests that can still make theirs go first, and it goes once
  its bound is the earliest, so it is served within about that bound rather than never;
- `shed` (sheddable classes): it is refused at once, 429 with Retry-After and the reason, as the
  engine refuses a request that turned hopeless while queued, rather than spending the server on an
  answer that is already late.
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Any, NamedTuple


class Lateness(NamedTuple):
    """A waiter's class's late policy: how long past its deadline it may be served, or shed."""

    bound_s: float
    shed: bool


class LateShed(Exception):
    """A sheddable request's deadline passed while it waited at the gateway."""


class LateGate:
    """The waiters' late policies, and the re-keying of the gate's heap as deadlines pass."""

    def __init__(self) -> None:
        self._policy: dict[asyncio.Future[Any], tuple[float, Lateness]] = {}
        self.late = 0  # waiters re-keyed to their late bound, since start
        self.shed = 0  # waiters shed, since start

    def track(self, fut: asyncio.Future[Any], deadline: float, late: Lateness | None) -> None:
        """Watch a waiter until it is served, leaves, or turns late (then it needs watching no more)."""
        if late is not None:
            self._policy[fut] = (deadline, late)
            fut.add_done_callback(lambda done: self._policy.pop(done, None))

    def rekey(self, waiting: list[Any], now: float) -> list[Any]:
        """`waiting` (a heap of (key, seq, ..., fut)) with every waiter whose deadline has passed
        moved to its late bound, or shed; the same list when none is due (the common case: one
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
            out.append((deadline + late.bound_s, *item[1:]))
        if changed:
            heapq.heapify(out)
        return out
