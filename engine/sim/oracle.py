"""Exact costs for the ideal-preemption bound: what each request's prefill really took.

A simulation that predicts with the cost model and also charges the cost model's times is no
bound for the real engine: where the model is pessimistic, the simulated scheduler gives up on
requests the engine saves. The bound instead replays the run's own measurements: every executed
batch says how much slower or faster than the calibrated model it ran, each of its requests
inherits that factor, and the simulator both charges and predicts every batch with the
cost-weighted factor of its requests (perfect prediction, the real machine's speed at the time).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import replace

from engine.model.plan import OpCost, SeqSpan
from engine.observer import EngineObserver
from engine.prefill import PrefillBatch
from engine.request import Request
from engine.scheduler import Scheduler


class BatchCostRecorder(EngineObserver):
    """Watches a real engine: what every finished batch cost against what the calibrated model predicted."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[str], float, float]] = []

    def on_segment_end(self, batch: PrefillBatch, now: float) -> None:
        if batch.finished:
            self.batches.append(([r.request_id for r in batch.requests], batch.steps.base_cost, batch.exec_s))


class ExactCosts:
    def __init__(self, base: OpCost, factors: dict[str, float]) -> None:
        n = len(base.class_scale)  # the calibration, without any online correction:
        self.base = replace(base, scale=1.0, class_scale=[1.0] * n, class_observations=[0] * n,
                            class_first=[[] for _ in range(n)], machine=1.0)
        self.factors = factors
        self.default = statistics.median(factors.values()) if factors else 1.0

    @classmethod
    def from_batches(cls, base: OpCost, batches: Iterable[tuple[Sequence[str], float, float]]) -> ExactCosts:
        """batches: (request ids, predicted seconds in the calibrated model's units, measured seconds)."""
        predicted: dict[str, float] = {}
        measured: dict[str, float] = {}
        for ids, base_s, exec_s in batches:
            for rid in ids:  # a chunked request sums over its chunks
                predicted[rid] = predicted.get(rid, 0.0) + base_s
                measured[rid] = measured.get(rid, 0.0) + exec_s
        return cls(base, {rid: measured[rid] / p for rid, p in predicted.items() if p > 0})

    def factor(self, req: Request) -> float:
        return self.factors.get(req.request_id, self.default)

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

    def cannot_meet(self, reqs: Sequence[Request], predicted_s: float, tokens: int, now: float) -> bool:
        """Exact costs are measured ones: no margin for an unconfirmed calibration."""
        return reqs[0].deadline - now - predicted_s < 0

    def on_progress(self, batch: PrefillBatch) -> None:
        """Exact costs need no correction."""
