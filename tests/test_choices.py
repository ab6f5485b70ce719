"""OpenAI's n, in process through the worker's ASGI app (tests/test_gateway.py has the shapes through
`flowprefill serve`): ids, seeds, admission and metrics of a request that is n engine requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import EngineFactory
from test_engine import Sink

from engine.core.request import Request, SamplingParams
from engine.protocol.headers import KV_TO_HEADER, KV_TRANSPORT_HEADER
from engine.serving.worker import create_worker_app


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=16384, kv_block_size=64)
    yield factory
    factory.close()


def call(app: Any, method: str, path: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.request(method, path, json=body, headers=headers or {})
    return asyncio.run(asyncio.wait_for(go(), timeout))


def test_a_reused_id_whose_choice_ids_are_taken_gets_a_suffix(make_engine: EngineFactory) -> None:
    """(Found by review.) Another client's own "job-1" runs; "job" with n=2 would name its second
    choice "job-1": the request gets a unique id instead of a 400 it cannot fix."""
    eng = make_engine()
    app = create_worker_app(eng, "m")
    other = Request(request_id="job-1", prompt_token_ids=[65] * 8,
                    sampling=SamplingParams(max_tokens=8000, ignore_eos=True, temperature=0.0))
    eng.add_request(other)
    try:
        r = call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 2}, {"x-request-id": "job"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"].startswith("job-") and r.json()["id"] == r.headers["x-request-id"]
    finally:
        eng.cancel("job-1")


def test_seeds_at_the_top_of_their_range(make_engine: EngineFactory) -> None:
    app = create_worker_app(make_engine(), "m")
    body = {"prompt": "hello", "max_tokens": 2, "seed": 2**64 - 1, "temperature": 1.0}
    assert call(app, "POST", "/v1/completions", body).status_code == 200
    assert call(app, "POST", "/v1/completions", body | {"n": 2}).status_code == 200  # choice 1 wraps to 0
    r = call(app, "POST", "/v1/completions", body | {"seed": 2**64})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]


def test_admission_counts_every_choice(make_engine: EngineFactory) -> None:
    """max_waiting 4: a request of n=8 can never be admitted (400); with one request queued, n=4 or
    two prompts of n=2 would queue 5 (503); with none, n=4 is served."""
    eng = make_engine(max_waiting=4)
    app = create_worker_app(eng, "m")
    r = call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    held = eng.call(lambda: eng.kv.allocate_blocks(eng.kv.num_free_blocks))  # nothing fits: it stays queued
    queued = Request(request_id="queued", prompt_token_ids=[65] * 10)
    queued.sink = done = Sink(queued)
    eng.add_request(queued)
    for body in ({"prompt": "hello", "n": 4}, {"prompt": ["hello", "again"], "n": 2}):
        r = call(app, "POST", "/v1/completions", body | {"max_tokens": 2})
        assert r.status_code == 503 and r.headers["x-flowprefill-dropped-reason"] == "queue_full", body
    eng.call(lambda: eng._free_blocks(held))
    done.wait()
    assert call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 4}).status_code == 200


def test_a_request_of_n_choices_counts_once(make_engine: EngineFactory) -> None:
    app = create_worker_app(make_engine(), "m")
    r = call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 0}}
    deadline = time.monotonic() + 5
    while True:
        text = call(app, "GET", "/metrics").text
        values = {line.split(" ")[0].split("{")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
                  if line.startswith("flowprefill_") and "_total" in line}
        if values.get("flowprefill_generation_tokens_total") == 6 or time.monotonic() > deadline:
            break
    assert values["flowprefill_prompt_tokens_total"] == 5
    assert values["flowprefill_requests_finished_total"] == 1
    assert values["flowprefill_generation_tokens_total"] == 6


def test_a_disaggregated_prefill_takes_min_tokens(make_engine: EngineFactory) -> None:
    """(Found by review.) The prefill half runs one token: min_tokens above 1 must not refuse it."""
    app = create_worker_app(make_engine(), "m", role="prefill")
    r = call(app, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 16, "min_tokens": 5},
             {KV_TO_HEADER: "http://127.0.0.1:9", KV_TRANSPORT_HEADER: "http"})
    assert r.status_code == 502 and "handing the KV" in r.text  # it ran: only the hand-off had nowhere to go
