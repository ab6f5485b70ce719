"""FlowPrefill: S-EDF ranking, SLO-aware batching, preemption of the running batch at operator
boundaries, and resumption of suspended batches where they stopped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.prefill import PrefillBatch
from engine.core.request import Request
from engine.core.scheduler.slack import due, sedf_key

if TYPE_CHECKING:
    from engine.core.scheduler import Choice, Scheduler


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
        late = s.predict_s(head) > budget  # the head misses its due time even alone

        def fits(batch: list[Request]) -> bool:
            predicted = s.predict_batch_s(batch)
            return predicted <= budget or (late and merge_pays(s, batch, predicted))

        return s.fill(ordered, fits) or None


def merge_pays(s: Scheduler, batch: list[Request], predicted_s: float) -> bool:
    """Whether the batch's last request should join a head that is late anyway (`predicted_s`: the batch's
    prediction with it): it delays the others by its marginal time, and gains, against running as the
    next batch, its own time alone (the host's time per batch included) less that marginal time. It joins
    while the others lose no more than it gains: where the host's time per batch is large (3.8 ms on an
    H200 against 5-15 ms batches) or a batch's time grows less than linearly with its tokens, saturated
    batches merge; on a CPU, almost never."""
    *others, r = batch
    marginal = predicted_s - s.predict_batch_s(others)
    return marginal <= s.predict_s(r) - marginal
