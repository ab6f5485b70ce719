"""Slack-based EDF (S-EDF) ranking shared by the deadline-aware policies, with bounded lateness.

slack = deadline - now - predicted remaining execution. Requests that can still make their deadline
(*on time*) run first, earliest deadline first. Those that cannot are *late*: they go after the on-time
ones, so that a late request does not delay one that can still be saved, ranked by their *bound*
(deadline + their class's `late_ms`): a late interactive request is due long before a late batch one.

Behind on-time work alone, late work would wait for as long as on-time requests keep arriving: the
paper's S-EDF, in the simulator at 20 req/s, keeps 90 % on time by leaving the rest 26 s late at p99
(105x an interactive target), and on the real engine served long prompts 29-43 s late. So late work
has a guaranteed share of the engine (`LateShare`, `EngineConfig.late_share`), which it uses once it
needs it: a late request is *critical* when the late work due before it, with it, needs more than that
share of the time left to its bound; *lost* when not even the whole engine could make its bound.
While critical or lost work waits beside other work, it runs in turns, a `share` of the time: critical
first by bound (the late work that can still make it), then lost by bound, then the rest. So no late
request waits for the on-time stream, only for the late work due before it, at that share at worst.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.prefill import PrefillBatch
from engine.request import Request

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

Item = Request | PrefillBatch
ON_TIME, LATE, CRITICAL, LOST = 0, 1, 2, 3
SHARED = (CRITICAL, LOST)  # what the late tier's turns are for
# Ranks during the late tier's turn (else: on time first, then everything else by bound).
_TURN_RANK = {CRITICAL: 0, LOST: 1, ON_TIME: 2, LATE: 3}


def deadline_of(item: Item) -> float:
    return min(r.deadline for r in item.requests) if isinstance(item, PrefillBatch) else item.deadline


def bound_of(item: Item) -> float:
    return min(r.bound for r in item.requests) if isinstance(item, PrefillBatch) else item.bound


def remaining_of(s: Scheduler, item: Item) -> float:
    return s.remaining_s(item) if isinstance(item, PrefillBatch) else s.predict_s(item)


def slack(s: Scheduler, item: Item) -> float:
    return deadline_of(item) - s.now - remaining_of(s, item)


def standing(s: Scheduler, item: Item, remaining: float) -> int:
    """ON_TIME, LATE or LOST of one item alone (CRITICAL needs the others: `standings`)."""
    if deadline_of(item) - s.now - remaining >= 0:
        return ON_TIME
    return LATE if bound_of(item) - s.now - remaining >= 0 else LOST


def standings(s: Scheduler, items: Iterable[Item], share: float) -> tuple[dict[int, int], float]:
    """Every item's standing, by id, and when the next late one would turn critical (inf: none).
    Late work that can still make its bound, in bound order: an item is critical when the work up to
    it needs more than `share` of the time to its bound, and so is everything due before it."""
    out: dict[int, int] = {}
    late: list[tuple[float, float, int]] = []  # (bound, remaining, id)
    for item in items:
        remaining = remaining_of(s, item)
        out[id(item)] = state = standing(s, item, remaining)
        if state == LATE:
            late.append((bound_of(item), remaining, id(item)))
    late.sort()
    share = max(share, 1e-3)
    work, critical, turns_at = 0.0, -1, math.inf
    for k, (bound, remaining, _) in enumerate(late):
        work += remaining
        if (at := bound - work / share) <= s.now:
            critical = k
        else:
            turns_at = min(turns_at, at)
    for _, _, key in late[:critical + 1]:
        out[key] = CRITICAL
    return out, turns_at


def due(s: Scheduler, item: Item) -> float:
    """When its first token is due: its deadline while it is on time, its bound once it is late."""
    return deadline_of(item) if s.standing(item) == ON_TIME else bound_of(item)


def sedf_key(s: Scheduler, item: Item) -> tuple[int, float]:
    """On time first by deadline, then late by bound; during the late tier's turn, critical and lost
    work first (see the module's docstring)."""
    state = s.standing(item)
    at = deadline_of(item) if state == ON_TIME else bound_of(item)
    if s.late.turn:
        return (_TURN_RANK[state], at)
    return (int(state != ON_TIME), at)


class LateShare:
    """The late tier's guaranteed share of the engine while its work waits beside other work.

    `credit` is the time owed to late work: it grows by `share` x the time other work runs, and falls
    by (1 - share) x the time late work runs, while both wait. Late work's turn begins when the credit
    reaches `quantum_s` and ends when it is spent; the scheduler wakes itself up at either moment
    (`Scheduler.wake_at`), so turns need no other event. With share 0.5, turns of 100 ms each."""

    def __init__(self, share: float, quantum_s: float = 0.05) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"late share {share}: must be in [0, 1]")
        self.share, self.quantum_s = share, quantum_s
        self.credit = 0.0
        self.turn = False
        self._since: float | None = None
        self._contended = self._late_runs = False

    def account(self, now: float) -> None:
        """Before a decision: credit the time since the last one, and take or end the late turn."""
        if self._contended and self._since is not None:
            dt = now - self._since
            self.credit += self.share * dt - (dt if self._late_runs else 0.0)
            self.credit = max(-self.quantum_s, min(self.quantum_s, self.credit))
        self._since = now
        if self.turn and self.credit <= 1e-9:
            self.turn = False
        elif not self.turn and self.credit >= self.quantum_s - 1e-9 and self.share > 0:
            self.turn = True

    def decided(self, now: float, late_waits: bool, other_waits: bool, late_runs: bool) -> float:
        """After a decision: what runs until the next one. Returns when the turn changes (inf: never)."""
        self._contended, self._late_runs = late_waits and other_waits, late_runs
        if not self._contended:
            return math.inf
        if late_runs:
            rate = 1 - self.share
            at = now + self.credit / rate if rate > 0 else math.inf
        else:
            at = now + (self.quantum_s - self.credit) / self.share if self.share > 0 else math.inf
        # (a turn's end already due means the policy runs something else than the turn says, a batch
        # it will not preempt: deciding again at once would change nothing; the next event will)
        return at if at > now else math.inf
