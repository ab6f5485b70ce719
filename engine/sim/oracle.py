"""Exact costs for the ideal-preemption bound: what each request's prefill really took.

A simulation that predicts with the cost model and also charges the cost model's times is no
bound for the real engine: where the model is pessimistic, the simulated scheduler gives up on
requests the engine saves. The bound instead replays the run's own measurements: every executed
batch says how much slower or faster than the calibrated model it ran, each of its requests
inherits that factor, and the simulator both charges and predicts every batch with the
cost-weighted factor of its requests (perfect prediction, the real machine's speed at the time).

The bound plans each batch's steps as the engine did (with the correction the engine's plan was made
with), not with the factor: a plan's step sizes follow its scale, and each step adds a fixed cost (88
us on a 2-core EPYC), so a request measured 2x slow and replanned at 2x would be cut into twice the
steps and charged ~15 more overheads (+3 ms on a 30 ms prefill) than it really paid.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import replace

from engine.core.batch_log import MeasuredBatch, measured
from engine.core.observer import EngineObserver
from engine.core.prefill import PrefillBatch
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.model.cost import SIZE_CLASSES, OpCost, PrefillTerms, SeqSpan, size_class


class BatchCostRecorder(EngineObserver):
    """Watches a real engine: what every finished batch cost against what the calibrated model predicted."""

    def __init__(self) -> None:
        self.batches: list[MeasuredBatch] = []

    def on_segment_end(self, batch: PrefillBatch, now: float) -> None:
        if batch.finished:
            self.batches.append(measured(batch, now))


class ExactCosts:
    def __init__(self, base: OpCost, factors: dict[str, float], plan_scales: dict[str, float] | None = None) -> None:
        n = len(base.class_scale)  # the calibration, without any online correction:
        self.base = replace(base, scale=1.0, class_scale=[1.0] * n, class_observations=[0] * n,
                            class_first=[[] for _ in range(n)], machine=1.0)
        self.factors = factors
        self.plan_scales = plan_scales or {}
        self.default = statistics.median(factors.values()) if factors else 1.0

    @classmethod
    def from_batches(cls, base: OpCost, batches: Iterable[MeasuredBatch]) -> ExactCosts:
        predicted: dict[str, float] = {}
        measured: dict[str, float] = {}
        plan_scales: dict[str, float] = {}
        for b in (MeasuredBatch(*entry) for entry in batches):
            for rid in b.ids:  # a chunked request sums over its chunks (and plans as its last did)
                predicted[rid] = predicted.get(rid, 0.0) + b.base_s
                measured[rid] = measured.get(rid, 0.0) + b.exec_s
                if b.plan_scale is not None:
                    plan_scales[rid] = b.plan_scale
        return cls(base, {rid: measured[rid] / p for rid, p in predicted.items() if p > 0}, plan_scales)

    def factor(self, req: Request) -> float:
        return self.factors.get(req.request_id, self.default)

    def plan_cost(self, reqs: Sequence[Request]) -> OpCost:
        """The cost model a batch of these requests plans its steps with: the engine's correction when it
        planned them (their mean), or where that is unknown the exact one."""
        scales = [self.plan_scales.get(r.request_id) for r in reqs]
        if None in scales:
            return self.for_requests(reqs)
        return replace(self.base, scale=statistics.fmean(scales))  # type: ignore[arg-type]

    def for_requests(self, reqs: Sequence[Request]) -> OpCost:
        """The cost model that is exact for this batch: the base model scaled by its requests'
        measured factors, weighted by their predicted share of the work."""
        if len(reqs) == 1:
            return replace(self.base, scale=self.factor(reqs[0]))
        shares = [self.base.prefill_s([SeqSpan(r.num_computed_tokens, r.remaining_prefill_tokens)]) for r in reqs]
        total = sum(shares) or 1.0
        return replace(self.base, scale=sum(s * self.factor(r) for s, r in zip(shares, reqs, strict=True)) / total)


class OracleScheduler(Scheduler):
    """The real scheduler, predicting with exact costs."""

    exact: ExactCosts

    def cost_for(self, reqs: Sequence[Request]) -> OpCost:
        return self.exact.for_requests(reqs)

    def predict_batch_s(self, reqs: Sequence[Request], terms: PrefillTerms | None = None) -> float:
        """What the batch will be charged: planned at the engine's scale, at the measured factor per
        planned second. Predicting at the factor alone counted the step overheads of a plan cut at it:
        for a request measured 2x slow (88 us per step), 1.21x / 1.10x what a 200 / 1,500-token prefill
        is charged; 1.15x / 1.05x this way (the rest is `prefill_s`'s own estimate of the split)."""
        plan = self.exact.plan_cost(reqs)
        spans = [SeqSpan(r.num_computed_tokens, r.remaining_prefill_tokens) for r in reqs]
        return plan.prefill_s(spans) * self.exact.for_requests(reqs).scale / plan.scale

    def cannot_meet(self, reqs: Sequence[Request], predicted_s: float, tokens: int, now: float) -> bool:
        """Exact costs are measured ones: no margin for an unconfirmed calibration."""
        return reqs[0].latest - now - predicted_s < 0

    def on_progress(self, batch: PrefillBatch) -> None:
        """Exact costs need no correction."""

    def on_host_gap(self, seconds: float) -> None:
        """Exact costs charge the host's time as given."""


def sized(b: MeasuredBatch) -> bool:
    """Whether a logged batch says its size and both its times: what a speed per size can read."""
    return bool(b.tokens) and b.base_s > 0 and b.exec_s > 0


def factors_by_size(batches: Iterable[MeasuredBatch]) -> list[list[float]]:
    """Per batch size class (`SIZE_CLASSES`), the measured over calibrated seconds of the batches of that
    size (none where the logs do not say the batches' sizes)."""
    by_class: list[list[float]] = [[] for _ in range(len(SIZE_CLASSES) + 1)]
    for b in (MeasuredBatch(*entry) for entry in batches):
        if sized(b):
            by_class[size_class(b.tokens or 0)].append(b.exec_s / b.base_s)
    return by_class


def speed_by_size(batches: Iterable[MeasuredBatch]) -> list[float] | None:
    """Per batch size class (`SIZE_CLASSES`), the median of measured over calibrated seconds of the
    batches of that size; a class no batch measured takes its nearest measured one's (the longer on a
    tie). None: the logs do not say the batches' sizes. The factor falls with the size: on 2 EPYC cores
    through `serve`, 2.9-4.4x for batches predicted under 10 ms, 1.6-2.0x over 0.8 s, so one median
    for the machine (about 2, most requests being short) charged long prompts a fifth too much."""
    by_class = factors_by_size(batches)
    seen = [k for k, factors in enumerate(by_class) if factors]
    if not seen:
        return None
    return [statistics.median(by_class[min(seen, key=lambda j: (abs(j - k), -j))]) for k in range(len(by_class))]


def at_speed(cost: OpCost, batches: Iterable[MeasuredBatch], default: float) -> OpCost:
    """`cost` running at the speed these batches measured: a factor per batch size where the logs say
    the sizes (its size classes' corrections, as if learned), else `default` for every size."""
    factors = speed_by_size(batches)
    if factors is None:
        return replace(cost, scale=default)
    return replace(cost, scale=1.0, machine=1.0, class_scale=list(factors), class_observations=[1] * len(factors),
                   class_first=[[f] for f in factors])
