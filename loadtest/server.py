"""What the server counted during a load test: the preemptions its FlowPrefill workers made, and
where their CPU went (the engines' compute threads, and the serving side beside them).

The load generator sees only HTTP answers; whether a long request was preempted shows in the
workers' `flowprefill_preemptions_total` counters, and how much of a worker's CPU its HTTP side took
(what an engine process of its own could at most hand back, engine/core/thread_cpu.py) in
`flowprefill_worker_cpu_seconds_total`. A FlowPrefill gateway lists its workers in
`GET /health`; each serves `GET /metrics`. Any other server (vLLM, SGLang, a gateway whose workers
this host cannot reach) has none to read, and the report says "unknown" rather than 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREEMPTIONS = "flowprefill_preemptions_total"
CPU = "flowprefill_worker_cpu_seconds_total"
TIMEOUT_S = 5.0


def workers(host: str) -> list[str]:
    """The worker URLs a FlowPrefill gateway names in /health (a worker's own URL when `host` is one)."""
    if not host:
        return []
    try:
        health = httpx.get(f"{host.rstrip('/')}/health", timeout=TIMEOUT_S).json()
    except (httpx.HTTPError, ValueError):
        return []
    listed = health.get("workers") if isinstance(health, Mapping) else None
    return sorted(listed) if isinstance(listed, Mapping) else [host.rstrip("/")]


class Counts(NamedTuple):
    """The workers' counters, summed: preemptions by "victim<-by" class pair, CPU seconds by threads
    (compute, serving); each None when no worker answered with them."""

    preemptions: dict[str, float] | None
    cpu: dict[str, float] | None


def scrape(urls: list[str]) -> Counts:
    """The counters of the workers at `urls` that answer with FlowPrefill metrics."""
    counts: dict[str, float] = {}
    cpu: dict[str, float] = {}
    seen = False
    for url in urls:
        try:
            answer = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S)
            samples = [s for family in text_string_to_metric_families(answer.text) for s in family.samples]
        except (httpx.HTTPError, ValueError):  # unreachable, or no Prometheus text (a 404 page): none to read
            continue
        for s in samples:
            if s.name == PREEMPTIONS:
                key = f"{s.labels.get('victim_class', '')}<-{s.labels.get('by_class', '')}"
                counts[key] = counts.get(key, 0.0) + s.value
            elif s.name == CPU:
                threads = s.labels.get("threads", "")
                cpu[threads] = cpu.get(threads, 0.0) + s.value
            if s.name.startswith("flowprefill_"):
                seen = True
    return Counts(counts if seen or counts else None, cpu if {"compute", "serving"} <= set(cpu) else None)


class ServerCounters:
    """The workers' preemptions between `start` and `stop`, by class pair, and their CPU (None: not readable)."""

    def __init__(self, host: str) -> None:
        self.urls = workers(host)
        self.before = scrape(self.urls)

    def stop(self) -> tuple[dict[str, int] | None, dict[str, float] | None]:
        after = scrape(self.urls)
        return self._preempted(after), self._cpu(after)

    def _preempted(self, after: Counts) -> dict[str, int] | None:
        before = self.before.preemptions
        if after.preemptions is None or before is None:
            return None
        return {k: round(v - before.get(k, 0.0)) for k, v in sorted(after.preemptions.items())
                if v - before.get(k, 0.0) > 0}

    def _cpu(self, after: Counts) -> dict[str, float] | None:
        """The CPU the workers' compute threads and serving sides took during the run (a worker that
        restarted meanwhile reads as less than nothing: none reported)."""
        before = self.before.cpu
        if after.cpu is None or before is None:
            return None
        compute, serving = (after.cpu[k] - before[k] for k in ("compute", "serving"))
        if compute < 0 or serving < 0 or compute + serving <= 0:
            return None
        return {"compute_s": round(compute, 3), "serving_s": round(serving, 3),
                "serving_share": round(serving / (compute + serving), 4)}
