"""Every request ends, also when its client leaves: a whole (non-streamed) answer whose client
disconnects is cancelled at once, through the gateway and straight to a worker, for every generating
endpoint and for every choice of n; its KV goes back and the gateway's in-flight gauge returns to 0.
A soak of 200 requests, a third of them abandoned mid-answer (whole and streamed), leaves nothing
behind and every other answer right."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from processes import serving, worker_of
from prometheus_client.parser import text_string_to_metric_families

LONG = {"max_tokens": 30000, "ignore_eos": True}  # far longer than any test waits: only a cancel ends it
ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 30000}),
}


@pytest.fixture(scope="module")
def url() -> Any:
    with serving("--model", "tiny", "--kv-capacity-tokens", "131072") as url:
        yield url


def _metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _post_then_leave(base: str, path: str, body: dict[str, Any], until: Any) -> float:
    """POSTs `body` on a raw socket, waits until `until()` is true (the answer is being computed),
    then closes the connection without reading anything: the moment it closed."""
    host, port = base.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(raw)}\r\n\r\n".encode() + raw)
    deadline = time.monotonic() + 30
    while not until():
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.01)
    sock.close()
    return time.monotonic()


def _idle_after(worker: str, since: float, timeout: float = 10) -> tuple[float, dict[str, Any]]:
    """Seconds from `since` until the worker decodes nothing and its KV is all free, and its /load then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = httpx.get(f"{worker}/load").json()
        if load["decoding"] == 0 and load["waiting"] == 0 and load["kv_cache_usage"] == 0.0:
            return time.monotonic() - since, load
        time.sleep(0.005)
    return float("inf"), load


@pytest.mark.parametrize("via", ["gateway", "worker"])
@pytest.mark.parametrize(("endpoint", "n"), [("completions", 1), ("completions", 3), ("chat", 1), ("chat", 2),
                                             ("responses", 1)])
def test_a_whole_answer_whose_client_leaves_is_cancelled(url: str, via: str, endpoint: str, n: int) -> None:
    worker = worker_of(url)
    base = url if via == "gateway" else worker
    path, body = ENDPOINTS[endpoint]
    body = {**LONG, **body} | ({"n": n} if n > 1 else {})
    if endpoint == "responses":
        body.pop("max_tokens")
    cancelled = _metric(worker, "flowprefill_requests_finished_total", finish_reason="cancelled")

    def decoding() -> bool:
        return httpx.get(f"{worker}/load").json()["decoding"] == n

    left = _post_then_leave(base, path, body, decoding)
    took, load = _idle_after(worker, left)
    # One decode step of the tiny model is a few ms; the bound leaves room for a loaded CI machine.
    assert took < 1.0, f"the worker still decodes {took:.2f} s after its client left: {load}"
    # counted once per HTTP request (telemetry/metrics.py counts n choices by the first); /load saw all n end
    assert _metric(worker, "flowprefill_requests_finished_total", finish_reason="cancelled") - cancelled == 1
    if via == "gateway":
        gauge = _metric(url, "flowprefill_gateway_in_flight", unit="requests")
        assert gauge == 0, f"the gateway still counts {gauge} request(s) in flight"


def _soak_client(url: str, i: int, prompts: list[str], outcome: dict[int, tuple[str, str]]) -> None:
    rng = random.Random(i)
    prompt = i % len(prompts)
    stream, leave = rng.random() < 0.5, rng.random() < 1 / 3
    body = {"prompt": prompts[prompt], "max_tokens": 2000 if leave else 24, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(rng.uniform(0.3, 1.5) if leave else 120)) as http:
            if not stream:
                r = http.post("/v1/completions", json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
                outcome[i] = ("whole", r.json()["choices"][0]["text"]) if ok else ("bad", r.text[:200])
                return
            text = ""
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                        if leave and rng.random() < 0.05:
                            break
            outcome[i] = ("left", "") if leave else ("whole", text)
    except httpx.TimeoutException:
        outcome[i] = ("left", "") if leave else ("bad", "timed out")


@pytest.mark.slow
def test_a_soak_with_a_third_of_the_clients_leaving_leaves_nothing_behind(url: str) -> None:
    worker = worker_of(url)
    idle_kv = httpx.get(f"{worker}/load").json()["kv_cache_usage"]
    prompts = [f"soak prompt {k}: " + "abc " * (10 + 7 * k) for k in range(8)]
    alone = {k: httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
        for k, p in enumerate(prompts)}
    outcome: dict[int, tuple[str, str]] = {}
    for wave in range(10):  # 20 clients at a time
        threads = [threading.Thread(target=_soak_client, args=(url, i, prompts, outcome))
                   for i in range(20 * wave, 20 * wave + 20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(outcome) == 200, "a client never finished"
    bad = {i: o for i, o in outcome.items() if o[0] == "bad" or (o[0] == "whole" and o[1] != alone[i % 8])}
    assert not bad, bad
    assert sum(o[0] == "left" for o in outcome.values()) >= 40, "too few clients left: the scenario did not happen"
    took, load = _idle_after(worker, time.monotonic())
    assert took < 10 and load["kv_cache_usage"] == idle_kv, load
    assert _metric(url, "flowprefill_gateway_in_flight") == 0
