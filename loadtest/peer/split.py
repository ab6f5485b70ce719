"""Where a gateway contender's time to first token went, from the gateway's own /metrics read before
and after a run: per class, the wait at the gateway (arrival to dispatch) and at the server (dispatch
to its first streamed bytes), each as a mean and a 90th percentile (interpolated within the histogram's
buckets, as Prometheus' histogram_quantile does). The rest of the client's TTFT is roughly the
gateway's path and the network (docs/deploy.md says what the two leave out). A contender without
those metrics (a server alone) has no split."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

# the gateway's histogram: what the report calls it
PARTS = {"flowprefill_gateway_queue_wait_seconds": "gateway_wait",
         "flowprefill_gateway_upstream_first_token_seconds": "server_first_token"}
Totals = dict[tuple[str, str, str], float]  # (histogram, class, "sum" | "count" | "le=BOUND") -> value


def read(url: str) -> Totals | None:
    """The histograms' sums, counts and buckets by class; empty when the target does not serve them,
    None when it could not be read (a run's split then is none, rather than since the gateway started)."""
    try:
        r = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return {}
    out: Totals = {}
    try:
        for family in text_string_to_metric_families(r.text):
            if family.name not in PARTS:
                continue
            for s in family.samples:
                part = s.name.removeprefix(family.name + "_")
                key = f"le={s.labels.get('le', '')}" if part == "bucket" else part
                out[(family.name, s.labels.get("slo_class", ""), key)] = s.value
    except ValueError:  # not Prometheus' text format (a server that answers every path alike)
        return {}
    return out


def split(before: Totals | None, after: Totals | None) -> dict[str, dict[str, float]]:
    """Per class, each part's mean and 90th percentile (ms) over what was observed between the reads."""
    if before is None or after is None:
        return {}
    seen: dict[tuple[str, str], dict[str, float]] = {}  # (histogram, class) -> its deltas
    for (name, cls, key), value in after.items():
        seen.setdefault((name, cls), {})[key] = value - before.get((name, cls, key), 0.0)
    out: dict[str, dict[str, float]] = {}
    for (name, cls), delta in seen.items():
        if (count := delta.get("count", 0.0)) <= 0:
            continue
        buckets = sorted((float(k.removeprefix("le=")), n) for k, n in delta.items() if k.startswith("le="))
        label = PARTS[name]
        out.setdefault(cls, {}).update({f"{label}_ms": round(delta["sum"] / count * 1000, 1),
                                        f"{label}_p90_ms": round(quantile(buckets, 0.9) * 1000, 1)})
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a histogram given as (upper bound, cumulative count), +Inf last: linear within
    the bucket it falls in; in the +Inf bucket, the last finite bound."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = upper, cumulative
    return lower
