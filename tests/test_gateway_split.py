"""Where a request's time to first token goes through the gateway: its wait at the gateway and at the
server, by class, on /metrics (`flowprefill_gateway_queue_wait_seconds`,
`flowprefill_gateway_upstream_first_token_seconds`), and `bench peer`'s per-run split read from them."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from processes import free_port, start, stop, uvicorn_thread, wait_healthy
from test_upstream import StreamingOpenAI

from loadtest.peer import split

pytestmark = pytest.mark.gateway_only


def test_the_split_of_two_requests_behind_one_slot() -> None:
    """The real gateway, one request at a time, in front of a server whose first token comes 0.3 s
    after a request reaches it: two streamed `standard` requests sent together. One goes at once, the
    other waits for the first's stream to end (0.3 s + 0.3 s held): on average 0.3 s at the gateway
    and 0.3 s at the server (each value in the middle of its bucket). A `batch` request sent before
    the first read is not in the run's split."""
    with uvicorn_thread(StreamingOpenAI(prefill_s=0.3, hold_s=0.3)) as up_port:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gw = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(port), "--upstream",
                   "openai", "--max-concurrency", "1")
        try:
            wait_healthy(url, gw)
            asyncio.run(_send(url, ["batch"]))
            before = split.read(url)
            asyncio.run(_send(url, ["standard", "standard"]))
            after = split.read(url)
        finally:
            stop(gw)
    parts = split.split(before, after)
    assert set(parts) == {"standard"}, parts
    assert parts["standard"]["gateway_wait_ms"] == pytest.approx(300, abs=100)
    assert parts["standard"]["server_first_token_ms"] == pytest.approx(300, abs=100)
    # within the buckets: the 0.5-0.75 s one holds the waiter's 0.6 s; the server's two in 0.25-0.5 s
    assert 500 <= parts["standard"]["gateway_wait_p90_ms"] <= 750
    assert 250 <= parts["standard"]["server_first_token_p90_ms"] <= 500
    assert split.read("http://127.0.0.1:9") is None  # nothing there: no split, no error
    assert split.split(None, after) == {} and split.split(before, None) == {}


def test_a_histograms_quantile_is_interpolated_within_its_bucket() -> None:
    """As Prometheus' histogram_quantile: 10 observations, 8 up to 0.1 s and 2 in 0.1-0.5 s; the 90th
    percentile is halfway into the second bucket; one past the last finite bound reads that bound."""
    assert split.quantile([(0.1, 8), (0.5, 10), (math.inf, 10)], 0.9) == pytest.approx(0.3)
    assert split.quantile([(0.1, 0), (0.5, 0), (math.inf, 4)], 0.9) == pytest.approx(0.5)
    assert math.isnan(split.quantile([(0.1, 0), (math.inf, 0)], 0.9))


async def _send(url: str, classes: list[str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        async def one(cls: str) -> None:
            r = await c.post("/v1/completions", headers={"x-slo-class": cls},
                             json={"prompt": "hi", "max_tokens": 1, "stream": True})
            assert r.status_code == 200, r.text
        await asyncio.gather(*(one(cls) for cls in classes))
