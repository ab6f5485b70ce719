"""First-come-first-served, non-preemptive prefill (DistServe's prefill instance)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.scheduler import Choice, Scheduler


class FCFS:
    name = "fcfs"

    def choose(self, s: Scheduler) -> Choice:
        if s.chosen is not None and s.chosen in s.pool:
            return s.chosen  # never preempt
        if s.pool:
            return s.pool[0]
        return s.fill(s.waiting) or None
