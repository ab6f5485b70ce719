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

Lost work that fits in one turn (*brief*: 100 ms at the defaults) ranks with the critical work: behind
it, a lost chat prompt 2 ms from done could wait for every turn an overload of long critical prompts
takes (18x its target at 4 req/s in the simulator); first, it costs them at most one turn. Lost long
work stays behind: all lost work first, by bound, would make the long prompts' lateness everyone's
(interactive p99 3.1x -> 48x at 5 req/s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.core.prefill import PrefillBatch
from engine.core.request import Request

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler

Item = Request | PrefillBatch
ON_TIME, LATE, CRITICAL, LOST, BRIEF_LOST = 0, 1, 2, 3, 4  # BRIEF_LOST: lost, and fits in one late turn (brief_s)
SHARED = (CRITICAL, LOST, BRIEF_LOST)  # what the late tier's turns are for
# Ranks during the late tier's turn (else: on time first, then everything else by bound).
_TURN_RANK = {CRITICAL: 0, BRIEF_LOST: 0, LOST: 1, ON_TIME: 2, LATE: 3}


def remaining_of(s: Scheduler, item: Item) -> float:
    return s.remaining_s(item) if isinstance(item, PrefillBatch) else s.predict_s(item)


def judge(s: Scheduler, item: Item, remaining: float) -> tuple[int, float]:
    """One item alone: ON_TIME, LATE or LOST (CRITICAL needs the others: `standings`), and when it is
    due (its deadline while on time, its bound once late). A batch's requests finish together; it is as
    urgent as the most savable of them: judged by a lost one's passed deadline, the batch, and an on-time
    request in it, would wait behind every on-time and late request (2.7 s for an interactive request
    78 ms into its prefill, at 4 req/s in the simulator). Judged by its most savable member, a batch
    formed for critical work that an on-time request joined runs as on-time work and serves its late
    request early too (interactive p99 at the knee 3.0x its target against 5.5x when judged by the late
    one; max goodput 4.53 against 4.06 req/s at prediction error sigma 1)."""
    end = s.now + remaining
    requests = item.requests if isinstance(item, PrefillBatch) else [item]
    counted = [r for r in requests if not r.state.done] or requests  # one cancelled in a batch no longer counts
    state, at = min((ON_TIME, r.deadline) if r.deadline >= end else (LATE, r.bound) if r.bound >= end
                    else (LOST, r.bound) for r in counted)
    return (BRIEF_LOST if state == LOST and remaining <= s.late.brief_s else state), at


def standings(s: Scheduler, items: Iterable[Item], share: float) -> tuple[dict[int, tuple[int, float]], float]:
    """Every item's (standing, due time), by id, and when the next late one would turn critical (inf:
    none). Late work that can still make its bound, in bound order: an item is critical when the work up
    to it (brief lost work included, which its turns serve first) needs more than `share` of the time to
    its bound, and so is everything due before it."""
    out: dict[int, tuple[int, float]] = {}
    late: list[tuple[float, float, int]] = []  # (bound, remaining, id)
    brief = 0.0  # brief lost work, which goes first in the late tier's turns
    for item in items:
        remaining = remaining_of(s, item)
        out[id(item)] = state, at = judge(s, item, remaining)
        if state == LATE:
            late.append((at, remaining, id(item)))
        elif state == BRIEF_LOST:
            brief += remaining
    late.sort()
    share = max(share, 1e-3)
    work, critical, turns_at = brief, -1, math.inf
    for k, (bound, remaining, _) in enumerate(late):
        work += remaining
        if (at := bound - work / share) <= s.now:
            critical = k
        else:
            turns_at = min(turns_at, at)
    for bound, _, key in late[:critical + 1]:
        out[key] = (CRITICAL, bound)
    return out, turns_at


def due(s: Scheduler, item: Item) -> float:
    """When its first token is due: its deadline while it is on time, its bound once it is late."""
    return s.judged(item)[1]


def sedf_key(s: Scheduler, item: Item) -> tuple[int, float]:
    """On time first by deadline, then late by bound; during the late tier's turn, critical and lost
    work first (see the module's docstring)."""
    state, at = s.judged(item)
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

    @property
    def brief_s(self) -> float:
        """Lost work this short is brief: one turn's worth (its credit spent at 1 - share), at most two
        quanta (100 ms), so that a share near 1, whose turns hardly end, does not make every lost prompt
        brief and bring back what brief work avoids (all lost work first: interactive p99 48x)."""
        return self.quantum_s / max(1 - self.share, 0.5)

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
