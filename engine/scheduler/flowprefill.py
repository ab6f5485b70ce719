"""FlowPrefill: S-EDF ranking, SLO-aware batching, preemption of the running batch at operator
boundaries, and resumption of suspended batches where they stopped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.prefill import PrefillBatch
from engine.request import Request
from engine.scheduler.slack import due, sedf_key

if TYPE_CHECKING:
    from engine.scheduler import Choice, Scheduler


class FlowPrefill:
    name = "flowprefill"
    ranks_by_slack = True  # the scheduler judges every candidate's standing for it (slack.py)
    guard = 0.1  # batching stops when the batch would eat the head's slack (to its due time) minus guard x its target

    def choose(self, s: Scheduler) -> Choice:
        candidates: list[Request | PrefillBatch] = [*s.pool, *s.waiting]
        if not candidates:
            return None
        head = min(candidates, key=lambda c: sedf_key(s, c))
        if isinstance(head, PrefillBatch):
            return head  # resume (or keep running) the most urgent batch
        ordered = sorted(s.waiting, key=lambda r: sedf_key(s, r))
        budget = due(s, head) - s.now - self.guard * head.ttft_target_s

        return s.fill(ordered, lambda batch: s.predict_batch_s(batch) <= budget) or None
