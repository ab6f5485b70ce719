"""Prometheus metrics of an engine worker (names fixed by SPEC: prefix flowprefill_)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.prefill import PrefillBatch
from engine.request import Request

if TYPE_CHECKING:
    from engine.engine import Engine

# OpenTelemetry GenAI semantic conventions' bucket boundaries for time to first token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class EngineMetrics:
    """An engine observer that keeps the worker's Prometheus metrics."""

    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("flowprefill_time_to_first_token_seconds", "Time to first token",
                              ["slo_class"], buckets=TTFT_BUCKETS, registry=r)
        self.attained = Counter("flowprefill_slo_attained", "Requests whose TTFT met their class target",
                                ["slo_class"], registry=r)
        self.violated = Counter("flowprefill_slo_violated", "Requests whose TTFT missed their class target",
                                ["slo_class"], registry=r)
        self.preemptions = Counter("flowprefill_preemptions", "Prefill batches preempted",
                                   ["victim_class", "by_class"], registry=r)
        self.stop_latency = Histogram("flowprefill_preemption_latency_seconds",
                                      "Preemption decided -> running batch suspended",
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0), registry=r)
        Gauge("flowprefill_requests_waiting", "Requests queued for prefill", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("flowprefill_requests_running", "Requests decoding", registry=r).set_function(
            lambda: engine.num_decoding)
        Gauge("flowprefill_requests_preempted", "Prefill batches suspended", registry=r).set_function(
            lambda: max(0, len(engine.scheduler.pool) - (engine.scheduler.chosen is not None)))
        Gauge("flowprefill_kv_cache_usage_ratio", "Share of KV blocks in use", registry=r).set_function(
            lambda: engine.kv.usage)
        engine.observers.append(self)

    def on_preempt(self, victim: PrefillBatch, by: PrefillBatch) -> None:
        self.preemptions.labels(victim.head.slo_class, by.head.slo_class).inc()
        self.stop_latency.observe(victim.head.suspensions[-1].stop_latency_s)

    def on_finish(self, req: Request) -> None:
        if req.ttft is None:
            return
        self.ttft.labels(req.slo_class).observe(req.ttft)
        (self.attained if req.ttft <= req.ttft_target_s else self.violated).labels(req.slo_class).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GatewayMetrics:
    """The gateway's Prometheus metrics: requests by class and status, and shed requests by reason."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flowprefill_gateway_requests", "Requests answered by the gateway",
                                ["slo_class", "code"], registry=r)
        self.shed = Counter("flowprefill_gateway_shed", "Requests refused (shed) instead of served",
                            ["slo_class", "reason"], registry=r)

    def answered(self, slo_class: str, code: int, shed_reason: str | None = None) -> None:
        self.requests.labels(slo_class, str(code)).inc()
        if shed_reason:
            self.shed.labels(slo_class, shed_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
