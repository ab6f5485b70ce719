"""FlowPrefill: slack-based EDF ranking, SLO-aware batching, preemption of the running batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.plan import SeqSpan
from engine.prefill import PrefillBatch
from engine.request import Request

if TYPE_CHECKING:
    from engine.scheduler import Choice, Scheduler


class FlowPrefill:
    name = "flowprefill"
    guard = 0.1  # batching stops when predicted batch time would eat the head's slack minus guard x TTFT

    def choose(self, s: Scheduler) -> Choice:
        now = s.now

        def rank(item: Request | PrefillBatch) -> tuple[bool, float]:
            if isinstance(item, PrefillBatch):
                deadline = min(r.deadline for r in item.requests)
                remaining = item.remaining_s
            else:
                deadline, remaining = item.deadline, s.predict_s(item)
            # Requests that can still make their deadline first, by deadline; hopeless ones after.
            return (deadline - now - remaining < 0, deadline)

        candidates: list[Request | PrefillBatch] = [*s.pool, *s.waiting]
        if not candidates:
            return None
        head = min(candidates, key=rank)
        if isinstance(head, PrefillBatch):
            return head
        ordered = sorted(s.waiting, key=rank)
        slack = head.deadline - now - self.guard * head.ttft_target_s

        def fits(batch: list[Request]) -> bool:
            return s.cost.prefill_s([SeqSpan(0, r.num_prompt_tokens) for r in batch]) <= slack

        return s.fill(ordered, fits) or None

