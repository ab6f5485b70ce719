"""A real Prometheus server (Debian's `prometheus`, installed by .ci/run) scrapes `flowprefill serve`
with the shipped scrape config; PromQL over its HTTP API sees the contract's metrics
(docs/reference.md), and every query of the shipped Grafana dashboard evaluates."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from processes import free_port, preemption_scenario, start, stop, wait_healthy, worker_of

DEPLOY = Path(__file__).resolve().parents[1] / "telemetry" / "deploy"
PROMETHEUS = shutil.which("prometheus")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    PROMETHEUS is None, reason="needs Debian's prometheus package (.ci/run installs it)")]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(gateway url, prometheus url): serve + Prometheus scraping it every 0.5 s."""
    tmp = tmp_path_factory.mktemp("prometheus")
    port, prom_port = free_port(span=2), free_port()
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    cfg["global"] |= {"scrape_interval": "500ms", "evaluation_interval": "500ms"}
    targets = {"flowprefill-gateway": [f"127.0.0.1:{port}"], "flowprefill-worker": [f"127.0.0.1:{port + 1}"]}
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    serve = start("serve", "--model", "tiny", "--port", str(port), "--kv-capacity-tokens", "65536", "--threads", "1")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", serve)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
    finally:
        stop(serve)
        prom.terminate()
        prom.wait(timeout=20)


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for(prom: str, expr: str, ok: Any, timeout: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        result = query(prom, expr)
        if ok(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_promql_sees_preemptions_and_ttft_by_class(scraped: tuple[str, str]) -> None:
    gateway, prom = scraped
    wait_for(prom, 'up{job=~"flowprefill-.*"} == 1', lambda r: len(r) == 2)
    results = preemption_scenario(gateway)
    assert all(r.status_code == 200 for r in results.values())
    worker_text = httpx.get(f"{worker_of(gateway)}/metrics").text
    counted = sum(float(line.split()[-1]) for line in worker_text.splitlines()
                  if line.startswith("flowprefill_preemptions_total{"))
    assert counted >= 1

    pre = wait_for(prom, "sum by (victim_class, by_class) (flowprefill_preemptions_total)",
                   lambda r: sum(float(s["value"][1]) for s in r) == counted)
    assert {(s["metric"]["victim_class"], s["metric"]["by_class"]) for s in pre} == {("batch", "interactive")}
    assert sum(float(s["value"][1]) for s in pre) == counted

    ttft = wait_for(prom, "sum by (slo_class) (flowprefill_time_to_first_token_seconds_count)",
                    lambda r: len(r) == 2)
    assert {s["metric"]["slo_class"]: float(s["value"][1]) for s in ttft} == {"batch": 1.0, "interactive": 3.0}
    buckets = query(prom, "sum by (slo_class, le) (flowprefill_time_to_first_token_seconds_bucket)")
    assert {s["metric"]["le"] for s in buckets} >= {"0.25", "+Inf"}  # GenAI semantic-convention buckets
    p99 = query(prom, "histogram_quantile(0.99, sum by (slo_class, le) "
                      "(flowprefill_time_to_first_token_seconds_bucket))")
    assert {s["metric"]["slo_class"] for s in p99} == {"batch", "interactive"}

    gw = wait_for(prom, "sum by (slo_class, code) (flowprefill_gateway_requests_total)", lambda r: len(r) == 2)
    assert {(s["metric"]["slo_class"], s["metric"]["code"]): float(s["value"][1]) for s in gw} == {
        ("batch", "200"): 1.0, ("interactive", "200"): 3.0}
    # The predictor's error per finished batch, and its learned correction, by batch size class.
    ratio = wait_for(prom, "sum by (batch_tokens_le) (flowprefill_prefill_prediction_ratio_count)",
                     lambda r: sum(float(s["value"][1]) for s in r) >= 2)
    assert sum(float(s["value"][1]) for s in ratio) >= 2
    correction = query(prom, "flowprefill_prefill_time_correction")
    assert {s["metric"]["batch_tokens_le"] for s in correction} == {"128", "512", "2048", "8192", "+Inf"}
    assert any(float(s["value"][1]) != 1.0 for s in correction)
    info = query(prom, "flowprefill_engine_info")
    assert info and info[0]["metric"]["policy"] == "flowprefill" and info[0]["metric"]["model"]


def test_dashboard_queries_evaluate(scraped: tuple[str, str]) -> None:
    """Every panel of the shipped Grafana dashboard is valid PromQL over metrics that exist."""
    _, prom = scraped
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "flowprefill.json").read_text())
    # Families as Prometheus learnt them from the scrapes (also those with no sample yet).
    metadata = httpx.get(f"{prom}/api/v1/metadata", timeout=10).json()["data"]
    known = {name + suffix for name, meta in metadata.items() if name.startswith("flowprefill_")
             for suffix in ({"histogram": ("_bucket", "_count", "_sum"), "counter": ("", "_total")}.get(
                 meta[0]["type"], ("",)))}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        query(prom, expr.replace("$__rate_interval", "1m"))
        names = {w for w in _words(expr) if w.startswith("flowprefill_")}
        for name in names:
            assert name in known, f"{expr}: no metric {name}"


def _words(expr: str) -> list[str]:
    import re

    return re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
