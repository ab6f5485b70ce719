"""What the server counted during a load test: the preemptions its FlowPrefill workers made.

The load generator sees only HTTP answers; whether a long request was preempted shows in the
workers' `flowprefill_preemptions_total` counters. A FlowPrefill gateway lists its workers in
`GET /health`; each serves `GET /metrics`. Any other server (vLLM, SGLang, a gateway whose workers
this host cannot reach) has none to read, and the report says "unknown" rather than 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREEMPTIONS = "flowprefill_preemptions_total"
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


def preemptions(urls: list[str]) -> dict[str, float] | None:
    """`flowprefill_preemptions_total` summed over the workers, by "victim<-by" class pair; None when
    no worker answered with FlowPrefill metrics."""
    counts: dict[str, float] = {}
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
            elif s.name.startswith("flowprefill_"):
                seen = True
    return counts if seen or counts else None


class PreemptionCounter:
    """The workers' preemptions between `start` and `stop`, by class pair (None: not readable)."""

    def __init__(self, host: str) -> None:
        self.urls = workers(host)
        self.before = preemptions(self.urls)

    def stop(self) -> dict[str, int] | None:
        after = preemptions(self.urls)
        if after is None or self.before is None:
            return None
        return {k: round(v - self.before.get(k, 0.0)) for k, v in sorted(after.items())
                if v - self.before.get(k, 0.0) > 0}
