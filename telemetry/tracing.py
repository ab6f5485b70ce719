"""OpenTelemetry traces of every request and every preemption.

Configured only by the standard `OTEL_*` environment variables, so a default Jaeger (4317 gRPC,
4318 HTTP) shows everything with no extra setting. Off unless an OTLP endpoint or exporter is named;
when off nothing is installed (no plugin, no engine observer), so it costs nothing.

Engine spans are opened and closed on the engine thread with the engine's own clock readings, so
queue + prefill segments + preempted intervals follow one another to the nanosecond from the
request's arrival to its last prefill segment; decode starts at the first token, once it is sampled.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from engine.core.observer import EngineObserver

if TYPE_CHECKING:
    from engine.core.engine import Engine
    from engine.core.prefill import PrefillBatch
    from engine.core.request import Request
from telemetry.metrics import flowprefill_version

log = logging.getLogger(__name__)

TRACER_NAME = "flowprefill"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_enabled() -> bool:
    """On when an OTLP endpoint or a traces exporter is configured, unless the SDK is disabled."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return bool(exporter) or any(os.environ.get(v) for v in _ENDPOINT_VARS)


def _exporter() -> SpanExporter:
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "console":
        return ConsoleSpanExporter()
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter
    return HTTPExporter()  # reads the endpoint, headers, timeout and compression variables itself


def setup_tracing(service: str) -> TracerProvider | None:
    """Install a global tracer provider exporting over OTLP, or return None when tracing is off.
    The sampler comes from OTEL_TRACES_SAMPLER(_ARG); batching from OTEL_BSP_*."""
    if not tracing_enabled():
        return None
    from telemetry.protos import advice, replaced

    if damaged := replaced():  # the OTLP exporters would fail to import: say why, serve untraced
        log.error("tracing is off: %s", advice(damaged))
        return None
    attrs: dict[str, Any] = {SERVICE_VERSION: flowprefill_version()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs[SERVICE_NAME] = service
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    trace.set_tracer_provider(provider)
    return provider


def litestar_plugin(exclude: list[str]) -> Any:
    """Litestar's OpenTelemetry plugin: a server span per HTTP request, W3C context extracted from
    the incoming headers. Per-chunk send/receive spans are left out (a stream has hundreds)."""
    from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin

    return OpenTelemetryPlugin(OpenTelemetryConfig(exclude=exclude, exclude_spans=["receive", "send"]))


def inject(headers: dict[str, str]) -> None:
    """Write the current trace context into outgoing headers (W3C traceparent/tracestate)."""
    propagate.inject(headers)


class _RequestTrace:
    __slots__ = ("preempted", "prefill", "queue", "root")

    def __init__(self, root: Span) -> None:
        self.root = root
        self.queue: Span | None = None
        self.prefill: Span | None = None
        self.preempted: Span | None = None


class EngineTracer(EngineObserver):
    """Worker-side spans: a request span with children `queue`, `prefill` (one per execution
    segment), `preempted` (one per suspension, linked to the preempting request's prefill span)
    and `decode`. An answer evicted while decoding queues and prefills again: `queue` (marked
    `flowprefill.evicted`) and `prefill` spans inside its `decode` span."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.tracer = trace.get_tracer(TRACER_NAME, flowprefill_version())
        self.model = model
        # Engine times are monotonic seconds; spans want epoch nanoseconds.
        self._mono0, self._wall0 = engine.clock(), time.time_ns()
        self._clock = engine.clock
        # Each request's spans, by the request object (not its id string: a duplicate id refused at
        # add_request must not close the trace of the request that holds it). Written on the HTTP
        # thread before the engine sees the request, read on the engine thread.
        self._traces: dict[int, tuple[Request, _RequestTrace]] = {}
        engine.observers.append(self)

    def _ns(self, t: float) -> int:
        return self._wall0 + int((t - self._mono0) * 1e9)

    def start(self, req: Request, operation: str, handed_off: bool = False) -> None:
        """Open the request's span as a child of the current (HTTP server) span. Call before the
        engine sees the request; everything after happens on the engine thread. A handed-off request
        (PD disaggregation: prefilled elsewhere) has no queue or prefill here, only decode."""
        ctx = context.get_current()
        root = self.tracer.start_span(f"{operation} {self.model}", context=ctx, kind=SpanKind.INTERNAL,
                                      start_time=self._ns(req.arrival_time), attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "flowprefill",
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": req.sampling.max_tokens,
            "gen_ai.request.temperature": req.sampling.temperature,
            "gen_ai.usage.input_tokens": req.num_prompt_tokens,
            "flowprefill.request_id": req.request_id,
            "flowprefill.slo_class": req.slo_class,
            "flowprefill.ttft_target_ms": req.ttft_target_s * 1000,
            "flowprefill.predicted_miss": req.predicted_miss,
        })
        if (guide := req.sampling.guide) is not None:  # structured output: what the answer is held to
            root.set_attributes({"gen_ai.output.type": "json" if guide.kind == "json" else "text",
                                 "flowprefill.structured_output": guide.kind})
        rt = _RequestTrace(root)
        if not handed_off:
            rt.queue = self._child(rt, "queue", req.arrival_time)
        self._traces[id(req)] = (req, rt)  # the request held too: its id stays its own while here

    def _trace(self, req: Request) -> _RequestTrace | None:
        found = self._traces.get(id(req))
        return None if found is None else found[1]

    def span(self, name: str, attrs: dict[str, Any]) -> Any:
        """A span in the current context (e.g. `kv_transfer` around a KV hand-off)."""
        return self.tracer.start_as_current_span(name, attributes=attrs)

    def _child(self, rt: _RequestTrace, name: str, start: float, **kw: Any) -> Span:
        return self.tracer.start_span(name, context=trace.set_span_in_context(rt.root),
                                      start_time=self._ns(start), **kw)

    def on_segment_start(self, batch: PrefillBatch, now: float) -> None:
        members = [r.request_id for r in batch.requests]
        for r in batch.requests:
            rt = self._trace(r)
            if rt is None or r.state.done:
                continue
            if rt.queue is not None:
                rt.queue.end(self._ns(now))
                rt.queue = None
            if rt.preempted is not None:
                rt.preempted.end(self._ns(now))
                rt.preempted = None
            rt.prefill = self._child(rt, "prefill", now, attributes={
                "flowprefill.batch.id": batch.batch_id,
                "flowprefill.batch.request_ids": members,
                "flowprefill.batch.tokens": batch.num_tokens,
                "flowprefill.segment": len(r.times.segments),
                "flowprefill.start_step": batch.next_step,
                "flowprefill.steps": len(batch.steps),
            })

    def on_segment_end(self, batch: PrefillBatch, now: float) -> None:
        for r, whole in zip(batch.requests, batch.completes_prefills, strict=True):
            rt = self._trace(r)
            if rt is None or rt.prefill is None:
                continue
            rt.prefill.set_attribute("flowprefill.end_step", batch.next_step)
            rt.prefill.end(self._ns(now))
            rt.prefill = None
            if batch.finished and not whole and not r.state.done:  # one chunk done: queued again
                rt.queue = self._child(rt, "queue", now, attributes={"flowprefill.chunk_wait": True})

    def on_preempt(self, victim: PrefillBatch, by: PrefillBatch) -> None:
        links = [Link(rt.prefill.get_span_context(), {"flowprefill.request_id": b.request_id})
                 for b in by.requests if (rt := self._trace(b)) is not None and rt.prefill is not None]
        for r in victim.requests:
            rt = self._trace(r)
            if rt is None or r.state.done or not r.times.suspensions:
                continue
            s = r.times.suspensions[-1]
            rt.preempted = self._child(rt, "preempted", s.start, links=links, attributes={
                "flowprefill.preempted_by": s.preempted_by,
                "flowprefill.layer": s.layer,
                "flowprefill.operator": s.operator,
                "flowprefill.tokens_done": s.tokens_done,
                "flowprefill.victim_class": r.slo_class,
                "flowprefill.by_class": s.by_class,
                "flowprefill.stop_latency_ms": s.stop_latency_s * 1000,
                # beyond the contract (docs/reference.md): on a GPU, the queued steps the stop waited for
                # and their predicted time
                "flowprefill.stop_queued_steps": s.queued_steps,
                "flowprefill.stop_queued_predicted_ms": s.queued_predicted_s * 1000,
            })

    def on_evict(self, req: Request, now: float) -> None:
        rt = self._trace(req)
        if rt is not None:  # queued again, its prompt and answer to be recomputed (less what is cached)
            rt.queue = self._child(rt, "queue", now, attributes={
                "flowprefill.evicted": True, "flowprefill.output_tokens": len(req.output_token_ids),
                "flowprefill.recompute_tokens": req.remaining_prefill_tokens})

    def on_finish(self, req: Request) -> None:
        _, rt = self._traces.pop(id(req), (None, None))
        if rt is None:
            return
        end = req.times.finish_time if req.times.finish_time is not None else self._clock()
        for span in (rt.queue, rt.prefill, rt.preempted):  # cancelled or failed mid-way
            if span is not None:
                span.set_attribute("flowprefill.interrupted_by", req.finish_reason or "")
                span.end(self._ns(end))
        root = rt.root
        if req.times.first_token_time is not None:
            self._child(rt, "decode", req.times.first_token_time, attributes={
                "gen_ai.usage.output_tokens": len(req.output_token_ids)}).end(self._ns(end))
            root.set_attribute("flowprefill.ttft_ms", req.ttft * 1000)
            root.set_attribute("flowprefill.slo_attained", req.ttft <= req.ttft_target_s)
        root.set_attribute("gen_ai.usage.output_tokens", len(req.output_token_ids))
        root.set_attribute("gen_ai.response.finish_reasons", [req.finish_reason or ""])
        root.set_attribute("flowprefill.preemptions", len(req.times.suspensions))
        root.set_attribute("flowprefill.evictions", req.times.evictions)
        root.set_attribute("flowprefill.cached_tokens", req.cached_tokens)
        if req.finish_reason == "error":
            root.set_status(Status(StatusCode.ERROR, "engine error"))
        root.end(self._ns(end))
