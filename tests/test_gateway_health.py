"""The gateway tells why a worker is unhealthy, each reason once until it recovers (and the recovery), and its
/health answers 503 while a pool a request needs has no healthy worker. The workers here are real
HTTP servers in this process: one that answers like a plain OpenAI server (no /load), one that
answers like a flowprefill decode worker, and a port nobody listens on."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import answers, free_port, stop, uvicorn_thread, wait_healthy

from gateway.netio import UpstreamTransport
from gateway.routing import WorkerPool

pytestmark = pytest.mark.gateway_only

PLAIN_OPENAI = "GET /load answered 404: a plain OpenAI server? use --upstream openai"
REFUSED = "unreachable (connection refused)"


class Server:
    """An HTTP server's answers: /health 200; /load 404 (a plain OpenAI server) until `role` is set,
    then a flowprefill worker's load report. Counts the requests per path."""

    def __init__(self, role: str | None = None) -> None:
        self.role, self.hits = role, Counter[str]()
        self.flapping = False  # every other /load answers 500 instead

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.hits[scope["path"]] += 1
        status, body = 404, {"detail": "Not Found"}
        if scope["path"] == "/health":
            status, body = 200, {"status": "ok"}
        elif scope["path"] == "/load" and self.flapping and self.hits["/load"] % 2:
            status, body = 500, {"detail": "Internal Server Error"}
        elif scope["path"] == "/load" and self.role:
            status, body = 200, {"role": self.role, "predicted_backlog_s": 0.0}
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def poll(pool: WorkerPool, times: int) -> None:
    for _ in range(times):
        await pool.poll_once()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flowprefill.gateway"]


def client() -> httpx.AsyncClient:
    """The gateway's own HTTP client (gateway/netio.py)."""
    return httpx.AsyncClient(transport=UpstreamTransport(httpx.Limits(), httpx.create_ssl_context()),
                             timeout=httpx.Timeout(5, connect=2))


def test_each_change_of_health_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    server = Server()
    dead = f"http://127.0.0.1:{free_port()}"
    with uvicorn_thread(server) as port, caplog.at_level(logging.INFO, "flowprefill.gateway"):
        url = f"http://127.0.0.1:{port}"

        async def main() -> None:
            async with client() as c:
                pool = WorkerPool([url, dead], c)
                await poll(pool, 3)
                assert not any(w.healthy for w in pool.workers)
                assert sorted(warnings(caplog)) == sorted([f"worker {url} unhealthy: {PLAIN_OPENAI}",
                                                           f"worker {dead} unhealthy: {REFUSED}"])
                caplog.clear()
                server.role = "colocated"  # it is a flowprefill worker after all
                await poll(pool, 2)
                assert warnings(caplog) == [f"worker {url} healthy again"] and pool.workers[0].healthy
                caplog.clear()
                server.role = "decode"  # now a worker of the wrong kind for this pool
                await poll(pool, 2)
                assert warnings(caplog) == [f"worker {url} unhealthy: it has role 'decode', but it is listed "
                                            "where colocated is needed: not routing to it"]

        asyncio.run(main())
    assert server.hits["/load"] == 7


def test_a_reason_that_comes_back_is_not_logged_again_until_the_worker_recovers(
        caplog: pytest.LogCaptureFixture) -> None:
    server = Server()
    server.flapping = True  # 500, 404, 500, 404, ...: two reasons, each logged once
    with uvicorn_thread(server) as port, caplog.at_level(logging.INFO, "flowprefill.gateway"):
        url = f"http://127.0.0.1:{port}"

        async def main() -> None:
            async with client() as c:
                pool = WorkerPool([url], c)
                await poll(pool, 6)
                assert warnings(caplog) == [f"worker {url} unhealthy: GET /load answered 500",
                                            f"worker {url} unhealthy: {PLAIN_OPENAI}"]
                caplog.clear()
                server.flapping, server.role = False, "colocated"
                await poll(pool, 1)
                server.role = None  # unhealthy again, for a reason already given: a new episode
                await poll(pool, 2)
                assert warnings(caplog) == [f"worker {url} healthy again", f"worker {url} unhealthy: {PLAIN_OPENAI}"]

        asyncio.run(main())


@contextmanager
def gateway(tmp_path: Path, *args: str) -> Iterator[tuple[str, Path]]:
    """`flowprefill gateway ARGS` on a free port, its stderr in a file: (its URL, that file)."""
    port, log = free_port(), tmp_path / "gateway.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--port", str(port), *args],
                                stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, ready=answers)
        yield url, log
    finally:
        stop(proc)


def test_gateway_in_front_of_a_plain_openai_server_says_why_and_is_unavailable(tmp_path: Path) -> None:
    server = Server()
    with uvicorn_thread(server) as port, gateway(tmp_path, "--workers", f"http://127.0.0.1:{port}") as (url, log):
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "reason": "no healthy worker",
                                 "workers": {f"http://127.0.0.1:{port}": False}}
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["x-flowprefill-dropped-reason"] == "no_healthy_worker"
        seen, deadline = server.hits["/load"], time.monotonic() + 30
        while server.hits["/load"] < seen + 2:  # two more health polls (one a second)
            assert time.monotonic() < deadline, "the gateway stopped polling"
            time.sleep(0.1)
    assert log.read_text().count(PLAIN_OPENAI) == 1, log.read_text()


def test_gateway_in_front_of_an_unreachable_worker_says_so(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway(tmp_path, "--workers", dead) as (url, log):
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["reason"] == "no healthy worker"
    assert f"worker {dead} unhealthy: {REFUSED}" in log.read_text()


def test_health_names_the_disaggregated_pool_with_no_healthy_worker(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with uvicorn_thread(Server(role="decode")) as port:
        decode = f"http://127.0.0.1:{port}"
        with gateway(tmp_path, "--workers", decode, "--prefill-workers", dead) as (url, _):
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["reason"] == "no healthy prefill worker"
            assert health.json()["workers"] == {decode: True, dead: False}
        with gateway(tmp_path, "--workers", decode) as (url, _):  # decode workers alone serve nothing
            assert httpx.get(f"{url}/health").json()["reason"] == "no healthy worker"


def test_a_connection_reset_during_a_health_check_is_retried_on_a_new_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    """A worker that resets the first connection (as a server whose keep-alive ran out can, mid-poll) and
    answers the next: healthy, and nothing logged (CI once logged a 404 twice around such a reset)."""
    import socket
    import struct
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    body = json.dumps({"role": "colocated", "predicted_backlog_s": 0.0}).encode()
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    connections = []

    def serve() -> None:
        for i in range(2):
            conn, _ = listener.accept()
            connections.append(conn)
            conn.recv(65536)  # the request
            if i == 0:  # reset: close at once with SO_LINGER 0, an RST instead of a FIN
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                conn.sendall(answer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def main() -> None:
        async with client() as c:
            pool = WorkerPool([url], c)
            pool.workers[0].healthy = False
            await pool.poll_once()
            assert pool.workers[0].healthy and not pool.workers[0].problems_logged

    with caplog.at_level(logging.WARNING, "flowprefill.gateway"):
        asyncio.run(main())
    thread.join(timeout=10)
    listener.close()
    assert len(connections) == 2 and warnings(caplog) == []
