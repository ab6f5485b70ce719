"""Slack-based EDF (S-EDF) ranking shared by the deadline-aware policies.

slack = deadline - now - predicted remaining execution. Requests that can still make their
deadline run first, earliest deadline first; those that cannot go after all of them, so a hopeless
request never delays one that can still be saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.prefill import PrefillBatch
from engine.request import Request

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


def deadline_of(item: Request | PrefillBatch) -> float:
    return min(r.deadline for r in item.requests) if isinstance(item, PrefillBatch) else item.deadline


def slack(s: Scheduler, item: Request | PrefillBatch) -> float:
    remaining = item.remaining_s if isinstance(item, PrefillBatch) else s.predict_s(item)
    return deadline_of(item) - s.now - remaining


def sedf_key(s: Scheduler, item: Request | PrefillBatch) -> tuple[bool, float]:
    return (slack(s, item) < 0, deadline_of(item))
