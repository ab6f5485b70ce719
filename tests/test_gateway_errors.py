"""What the gateway does with a worker's 5xx. Two scripted workers (a real uvicorn server each, in
this process) answer as a broken fleet would: a 500 for a request that trips a bug there, a 502 for
one they cannot serve now. A 500 goes back to the client as the worker wrote it, once, without
ejecting the worker; a 502 is retried on the other worker; a worker is ejected after repeated 5xx."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import asgi_body, free_port, start, stop, uvicorn_thread, wait_healthy

from gateway.routing import WorkerPool

pytestmark = pytest.mark.gateway_only


def scripted_worker(name: str, hits: Counter[tuple[str, str]]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        status, answer = 200, {"status": "ok", "role": "colocated", "predicted_backlog_s": 0.0}
        if scope["path"] == "/v1/completions":
            prompt = json.loads(body)["prompt"]
            hits[(name, prompt)] += 1
            status, answer = {"poison": (500, {"error": {"message": f"internal engine error at {name}",
                                                        "type": "server_error", "param": None, "code": None}}),
                              "unreachable": (502, {"error": {"message": "hand-off failed", "type": "server_error",
                                                              "param": None, "code": None}})}.get(
                prompt, (200, {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "ok"}]}))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    return app


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[str], Counter[tuple[str, str]]]]:
    hits: Counter[tuple[str, str]] = Counter()
    with ExitStack() as stack:
        ports = [stack.enter_context(uvicorn_thread(scripted_worker(n, hits))) for n in ("a", "b")]
        workers = [f"http://127.0.0.1:{p}" for p in ports]
        gw_port = free_port()
        gateway = start("gateway", "--port", str(gw_port), "--workers", ",".join(workers))
        url = f"http://127.0.0.1:{gw_port}"
        try:
            wait_healthy(url, gateway)
            yield url, workers, hits
        finally:
            stop(gateway)


def send(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)


def test_a_500_reaches_the_client_once_and_ejects_nobody(fleet: tuple[str, list[str], Counter]) -> None:
    url, _, hits = fleet
    r = send(url, "poison")
    assert r.status_code == 500 and r.json()["error"]["message"].startswith("internal engine error at ")
    assert sum(n for (_, prompt), n in hits.items() if prompt == "poison") == 1, "a 500 is not retried"
    assert all(httpx.get(f"{url}/health").json()["workers"].values())
    assert all(send(url, "hello").status_code == 200 for _ in range(4))


def test_a_502_is_retried_on_the_other_worker(fleet: tuple[str, list[str], Counter]) -> None:
    url, _, hits = fleet
    r = send(url, "unreachable")
    assert r.status_code == 502 and r.json()["error"]["message"] == "hand-off failed"  # both tried: the last answer
    assert hits[("a", "unreachable")] == hits[("b", "unreachable")] == 1


def test_repeated_5xx_eject_a_worker() -> None:
    pool = WorkerPool(["http://w"], httpx.AsyncClient())
    (w,) = pool.workers
    for _ in range(WorkerPool.ERRORS_TO_EJECT - 1):
        pool.record_error(w)
    pool.record_ok(w)  # a success in between: it was the requests, not the worker
    for _ in range(WorkerPool.ERRORS_TO_EJECT - 1):
        pool.record_error(w)
    assert w.healthy
    pool.record_error(w)
    assert not w.healthy and w.down_until > time.monotonic()


def test_api_keys_guard_every_route_with_openais_401(tmp_path: Path) -> None:
    hits: Counter[tuple[str, str]] = Counter()
    config = tmp_path / "gw.toml"
    config.write_text('[api_keys."sk-good"]\ndefault_class = "batch"\n')
    with uvicorn_thread(scripted_worker("a", hits)) as port:
        gw_port = free_port()
        gateway = start("gateway", "--port", str(gw_port), "--workers", f"http://127.0.0.1:{port}",
                        "--config", str(config))
        url = f"http://127.0.0.1:{gw_port}"
        try:
            wait_healthy(url, gateway)
            good = {"authorization": "Bearer sk-good"}
            for headers in ({}, {"authorization": "Bearer sk-bad"}):
                for r in (httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers),
                          httpx.get(f"{url}/v1/models", headers=headers)):
                    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                    assert r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=good)
            assert r.status_code == 200 and r.headers["x-slo-class"] == "batch"  # the key's class
            assert httpx.get(f"{url}/v1/models", headers=good).status_code != 401
            assert hits[("a", "hi")] == 1  # refused requests never reached the worker
        finally:
            stop(gateway)


def test_a_bug_of_the_gateways_is_an_openai_500_and_logged_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the gateway (here a prepare that raises) answered a bare `{"status_code":500}` and logged
    nothing; it is an OpenAI error body, with the traceback logged the first time and a line after."""
    import logging

    from litestar.testing import TestClient

    from gateway.app import create_gateway_app
    from gateway.config import GatewayConfig
    from gateway.forward import Forwarder

    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Forwarder, "prepare", broken)
    app = create_gateway_app(GatewayConfig(workers=[f"http://127.0.0.1:{free_port()}"]))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flowprefill.gateway").addHandler(handler)  # Litestar's logging config leaves caplog out
    try:
        with TestClient(app) as client:
            answers = [client.post("/v1/completions", json={"prompt": "hi"}) for _ in range(2)]
    finally:
        logging.getLogger("flowprefill.gateway").removeHandler(handler)
    for r in answers:
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "RuntimeError" in r.json()["error"]["message"]
    records = [r for r in records if "internal error on POST /v1/completions" in r.getMessage()]
    assert len(records) == 2 and records[0].exc_info and not records[1].exc_info
    assert "traceback logged before" in records[1].getMessage()
