"""Non-preemptive earliest-deadline-first (an ablation: EDF ordering without preemption)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.scheduler import Choice, Scheduler


class EDF:
    name = "edf"

    def choose(self, s: Scheduler) -> Choice:
        if s.chosen is not None and s.chosen in s.pool:
            return s.chosen
        return s.fill(sorted(s.waiting, key=lambda r: r.deadline)) or None
