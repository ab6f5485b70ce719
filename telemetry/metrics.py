"""Prometheus metrics of an engine worker and of the gateway (names fixed by docs/reference.md: prefix
flowprefill_)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.observer import EngineObserver

if TYPE_CHECKING:
    from engine.core.engine import Engine
    from engine.core.prefill import PrefillBatch
    from engine.core.request import Request
    from gateway.routing import WorkerPool

GOODPUT_WINDOW_S = 60.0


def flowprefill_version() -> str:
    try:
        return version("flowprefill")
    except PackageNotFoundError:
        return "unknown"

# OpenTelemetry GenAI semantic conventions' bucket boundaries for time to first token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# ... for time per output token (they hold the default classes' TBT targets, 0.1 and 0.2 s) ...
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# ... and for a request's duration.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


class EngineMetrics(EngineObserver):
    """An engine observer that keeps the worker's Prometheus metrics."""

    def __init__(self, engine: Engine, model: str = "") -> None:
        self.registry = r = CollectorRegistry()
        Info("flowprefill_engine", "What this worker serves and how", registry=r).info(
            {"model": model or engine.model.cfg.name, "policy": engine.policy.name, "version": flowprefill_version()})
        # Goodput over a sliding window: first tokens that met their target, per second.
        self._attained_at: deque[float] = deque()
        self._children: dict[tuple[Any, str], Any] = {}
        self._lock = threading.Lock()
        Gauge("flowprefill_goodput_requests_per_second",
              f"Requests per second that met their TTFT target, over the last {GOODPUT_WINDOW_S:.0f} s",
              registry=r).set_function(self._goodput)
        self._answer_metrics(r)
        self._scheduling_metrics(engine, r)
        self._prediction_metrics(engine, r)
        r.register(_WorkerCPUCollector(engine))
        engine.observers.append(self)

    def _answer_metrics(self, r: CollectorRegistry) -> None:
        """Per class: first tokens and their targets, the gaps between tokens, durations, tokens in and out."""
        self.ttft = Histogram("flowprefill_time_to_first_token_seconds", "Time to first token",
                              ["slo_class"], buckets=TTFT_BUCKETS, registry=r)
        self.attained = Counter("flowprefill_slo_attained", "Requests whose TTFT met their class target",
                                ["slo_class"], registry=r)
        self.violated = Counter("flowprefill_slo_violated", "Requests whose TTFT missed their class target",
                                ["slo_class"], registry=r)
        # Decode, as vLLM's metrics report it: each gap between two tokens of an answer (what a class's
        # TBT target bounds: le="0.1" / le="0.2" over the count is its attainment), each finished
        # answer's mean time per token, request durations, and tokens in and out.
        self.token_gap = Histogram("flowprefill_inter_token_latency_seconds", "Time between two tokens of an answer",
                                   ["slo_class"], buckets=TPOT_BUCKETS, registry=r)
        self.tpot = Histogram("flowprefill_time_per_output_token_seconds",
                              "A finished answer's mean time per token after the first", ["slo_class"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("flowprefill_request_duration_seconds", "Arrival to the last token (or the end)",
                                  ["slo_class"], buckets=DURATION_BUCKETS, registry=r)
        self.finished = Counter("flowprefill_requests_finished", "Requests ended, by how",
                                ["slo_class", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("flowprefill_prompt_tokens", "Prompt tokens of ended requests", ["slo_class"],
                                     registry=r)
        self.generation_tokens = Counter("flowprefill_generation_tokens", "Tokens generated", ["slo_class"],
                                         registry=r)

    def _scheduling_metrics(self, engine: Engine, r: CollectorRegistry) -> None:
        """Preemptions and evictions, the prefix cache, and the queues and KV cache as they are now."""
        self.preemptions = Counter("flowprefill_preemptions", "Prefill batches preempted",
                                   ["victim_class", "by_class"], registry=r)
        self.stop_latency = Histogram("flowprefill_preemption_latency_seconds",
                                      "Preemption decided -> running batch suspended",
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0), registry=r)
        self.evictions = Counter("flowprefill_decode_preemptions", "Answers evicted while decoding (their KV "
                                 "blocks taken back when the cache ran short), to be recomputed", ["slo_class"],
                                 registry=r)
        self.prefix_queries = Counter("flowprefill_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("flowprefill_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(their KV reused, not computed)", registry=r)
        Gauge("flowprefill_prefix_cache_blocks", "KV blocks findable by content (in use or free)",
              registry=r).set_function(lambda: engine.snapshot.cached_blocks)
        Gauge("flowprefill_requests_waiting", "Requests queued for prefill", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("flowprefill_requests_running", "Requests decoding", registry=r).set_function(
            lambda: engine.num_decoding)
        Gauge("flowprefill_requests_evicted", "Answers evicted while decoding, waiting for their recompute "
              "(their streams stalled)", registry=r).set_function(lambda: engine.snapshot.evicted)
        Gauge("flowprefill_requests_preempted", "Prefill batches suspended", registry=r).set_function(
            lambda: engine.snapshot.suspended)
        Gauge("flowprefill_kv_cache_usage_ratio", "Share of KV blocks in use", registry=r).set_function(
            lambda: engine.snapshot.load.kv_cache_usage)

    def _prediction_metrics(self, engine: Engine, r: CollectorRegistry) -> None:
        """How far the TTFT predictor, on which every slack rests, is off: per batch size class, each
        finished batch's measured over predicted time, and the correction the engine has learned."""
        from engine.model.cost import SIZE_CLASSES, size_class

        labels = [*map(str, SIZE_CLASSES), "+Inf"]
        self._class_label = lambda tokens: labels[size_class(tokens)]
        self.prediction = Histogram("flowprefill_prefill_prediction_ratio",
                                    "Measured / predicted execution time of each finished prefill batch",
                                    ["batch_tokens_le"], buckets=(0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
                                    registry=r)
        correction = Gauge("flowprefill_prefill_time_correction",
                           "The factor the cost model applies to its calibrated prefill time", ["batch_tokens_le"],
                           registry=r)
        for i, label in enumerate(labels):
            correction.labels(label).set_function(lambda i=i: engine.snapshot.corrections[i])
        Gauge("flowprefill_prefill_machine_factor", "How much slower than calibrated the device runs now, as the "
              "cost model learned it from measured steps (shared by every batch size)", registry=r
              ).set_function(lambda: engine.snapshot.load.machine_factor)

    def on_segment_end(self, batch: PrefillBatch, now: float) -> None:
        if batch.finished and batch.total_cost > 0 and batch.exec_s > 0:
            self.prediction.labels(self._class_label(batch.num_tokens)).observe(batch.exec_s / batch.total_cost)

    def on_preempt(self, victim: PrefillBatch, by: PrefillBatch) -> None:
        self.preemptions.labels(victim.head.slo_class, by.head.slo_class).inc()
        self.stop_latency.observe(victim.head.times.suspensions[-1].stop_latency_s)

    def on_evict(self, req: Request, now: float) -> None:
        self.evictions.labels(req.slo_class).inc()

    def on_tokens(self, reqs: list[Request], gaps: list[float | None]) -> None:
        # Per token, on the engine thread: labelled children looked up once per class, counts added
        # once per class and step.
        made: dict[str, int] = {}
        for req, gap in zip(reqs, gaps, strict=True):
            if req.kv_sink is None:  # a prefill worker's first token is counted where the answer decodes
                made[req.slo_class] = made.get(req.slo_class, 0) + 1
            if gap is not None:
                self._child(self.token_gap, req.slo_class).observe(gap)
        for cls, n in made.items():
            self._child(self.generation_tokens, cls).inc(n)

    def _child(self, metric: Histogram | Counter, cls: str) -> Any:
        child = self._children.get((metric, cls))
        if child is None:
            child = self._children[(metric, cls)] = metric.labels(cls)
        return child

    def on_finish(self, req: Request) -> None:
        if req.block_hashes is not None:  # looked up in the prefix cache at arrival
            self.prefix_queries.inc(req.num_prompt_tokens)
            self.prefix_hits.inc(req.cached_tokens)
        cls = req.slo_class
        n = len(req.output_token_ids)
        first, last = req.times.first_token_time, req.times.last_token_time
        if req.kv_sink is None and n > 1 and first is not None and last is not None:
            self.tpot.labels(cls).observe((last - first) / (n - 1))
        # A request counts once: a disaggregated one on its decode worker (its TTFT where it was
        # prefilled), one of n choices by its first choice.
        if req.choice:
            return
        if req.kv_sink is None:
            self.finished.labels(cls, req.finish_reason or "").inc()
            self.prompt_tokens.labels(cls).inc(req.num_prompt_tokens)
            if req.times.finish_time is not None:
                self.duration.labels(cls).observe(req.times.finish_time - req.arrival_time)
        if req.ttft is None or req.prefilled_elsewhere:
            return
        self.ttft.labels(cls).observe(req.ttft)
        met = req.ttft <= req.ttft_target_s
        (self.attained if met else self.violated).labels(cls).inc()
        if met:
            with self._lock:
                self._attained_at.append(time.monotonic())

    def _goodput(self) -> float:
        cutoff = time.monotonic() - GOODPUT_WINDOW_S
        with self._lock:
            while self._attained_at and self._attained_at[0] < cutoff:
                self._attained_at.popleft()
            return len(self._attained_at) / GOODPUT_WINDOW_S

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
        self.queued = Gauge("flowprefill_gateway_requests_queued",
                            "Requests waiting in the gateway's queue (plain OpenAI upstreams)", registry=r)
        # Where a request's time to first token goes: waiting at the gateway, then at the worker (the
        # rest, client TTFT less both, is roughly the gateway's own path and the network's).
        self.queue_wait = Histogram("flowprefill_gateway_queue_wait_seconds",
                                    "Arrival at the gateway to dispatch to a worker (first try), by class",
                                    ["slo_class"], buckets=TTFT_BUCKETS, registry=r)
        self.upstream_first_token = Histogram(
            "flowprefill_gateway_upstream_first_token_seconds",
            "Dispatch to the worker's first streamed bytes, by class (streamed completions and chats answered 200)",
            ["slo_class"], buckets=TTFT_BUCKETS, registry=r)

    def track_queue(self, depth: Callable[[], int]) -> None:
        self.queued.set_function(depth)

    def track_pools(self, pools: dict[str, WorkerPool | None]) -> None:
        """The pools' sizes and membership changes, read at each scrape (`pools`: by the option that
        lists them: workers, prefill_workers)."""
        self.registry.register(_PoolCollector({name: p for name, p in pools.items() if p is not None}))

    def waited(self, slo_class: str, seconds: float) -> None:
        self.queue_wait.labels(slo_class).observe(seconds)

    def first_token(self, slo_class: str, seconds: float) -> None:
        self.upstream_first_token.labels(slo_class).observe(seconds)

    def answered(self, slo_class: str, code: int, shed_reason: str | None = None) -> None:
        self.requests.labels(slo_class, str(code)).inc()
        if shed_reason:
            self.shed.labels(slo_class, shed_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EppMetrics(GatewayMetrics):
    """The endpoint picker's (`flowprefill epp`): the gateway's, and how long each pick takes."""

    def __init__(self) -> None:
        super().__init__()
        self.pick = Histogram("flowprefill_gateway_pick_duration_seconds",
                              "The endpoint picker's decision for one request (classification, ranking)",
                              buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
                              registry=self.registry)

    def observe_pick(self, seconds: float) -> None:
        self.pick.observe(seconds)


class _WorkerCPUCollector(Collector):
    """The CPU time of the engine's compute threads and of the rest of the worker (engine/core/thread_cpu.py)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Any:
        if self.engine.thread_cpu is None:  # the engine loop has not started
            return
        compute, serving = self.engine.thread_cpu.split()
        cpu = CounterMetricFamily("flowprefill_worker_cpu_seconds",
                                  "CPU time since the engine started: its compute threads, and the rest of the "
                                  "worker (serving: HTTP, tokenizing, JSON, SSE)", labels=["threads"])
        cpu.add_metric(["compute"], compute)
        cpu.add_metric(["serving"], serving)
        yield cpu


class _PoolCollector(Collector):
    """Workers per pool and state (healthy: in rotation; unhealthy: out until a check passes;
    draining: gone from discovery, finishing its requests), members joined and left, and what the
    gateway has in flight there: requests, and prompt tokens held against a token budget."""

    def __init__(self, pools: dict[str, WorkerPool]) -> None:
        self.pools = pools

    def collect(self) -> Any:
        size = GaugeMetricFamily("flowprefill_gateway_workers", "Workers in each pool, by state",
                                 labels=["pool", "state"])
        changes = CounterMetricFamily("flowprefill_gateway_worker_changes",
                                      "Workers that joined or left a pool (DNS discovery)", labels=["pool", "change"])
        in_flight = GaugeMetricFamily("flowprefill_gateway_in_flight",
                                      "Sent to a pool's workers and not yet answered: requests, and prompt tokens "
                                      "still in prefill against upstream.max_tokens_in_flight", labels=["pool", "unit"])
        late = CounterMetricFamily("flowprefill_gateway_late", "Waiters at the gateway (plain OpenAI upstreams) "
                                   "that could no longer meet their deadline: served by their late bound, or shed",
                                   labels=["pool", "outcome"])
        first_token = GaugeMetricFamily("flowprefill_gateway_first_token_estimate_seconds",
                                        "Dispatch to first token a waiter's slack is judged by, by prompt size "
                                        "(upstream.slack = observed)", labels=["pool", "prompt_tokens_le"])
        for name, pool in self.pools.items():
            healthy = sum(w.healthy for w in pool.workers)
            size.add_metric([name, "healthy"], healthy)
            size.add_metric([name, "unhealthy"], len(pool.workers) - healthy)
            size.add_metric([name, "draining"], len(pool.draining))
            changes.add_metric([name, "joined"], pool.joined)
            changes.add_metric([name, "left"], pool.left)
            workers = [*pool.workers, *pool.draining.values()]
            in_flight.add_metric([name, "requests"], sum(w.in_flight for w in workers))
            in_flight.add_metric([name, "prompt_tokens"], sum(w.tokens_in_flight for w in workers))
            late.add_metric([name, "served_late"], pool.late.late)
            late.add_metric([name, "shed"], pool.late.shed)
            for tokens, seconds in pool.service.estimates().items():
                first_token.add_metric([name, str(tokens)], seconds)
        yield from (size, changes, in_flight, late, first_token)
