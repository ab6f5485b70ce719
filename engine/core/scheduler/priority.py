"""Strict class priority with preemption (vLLM-style priority scheduling, an ablation):
the highest-priority class runs first, FCFS within a class; slack is ignored."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.prefill import PrefillBatch
from engine.core.request import Request

if TYPE_CHECKING:
    from engine.core.scheduler import Choice, Scheduler


def _key(item: Request | PrefillBatch) -> tuple[int, float]:
    reqs = item.requests if isinstance(item, PrefillBatch) else [item]
    return (-max(r.priority for r in reqs), min(r.arrival_time for r in reqs))


class Priority:
    name = "priority"

    def choose(self, s: Scheduler) -> Choice:
        candidates: list[Request | PrefillBatch] = [*s.pool, *s.waiting]
        if not candidates:
            return None
        head = min(candidates, key=_key)
        if isinstance(head, PrefillBatch):
            return head
        return s.fill(sorted(s.waiting, key=_key)) or None
