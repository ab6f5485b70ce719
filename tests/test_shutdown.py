"""A bounded graceful shutdown of `serve`, `worker` and `gateway`: on SIGTERM or a first Ctrl-C they
stop taking requests, let those in flight finish for up to --shutdown-timeout seconds, end the rest
with an explicit error (503 `shutting_down`, or a stream's error event) and exit 0, with no traceback;
a second Ctrl-C exits at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import asgi_body, free_port, needs_engine, start, stop, uvicorn_thread, wait_healthy, worker_of

TIMEOUT_S = 3.0
LONG = {"prompt": "hi", "max_tokens": 30000, "ignore_eos": True}  # only a shutdown ends it


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    """`flowprefill ARGS` in a session of its own (a terminal's Ctrl-C reaches its whole process group),
    on free ports, with the tiny model: the process, its URL and its stderr's file."""
    port = free_port(span=2)
    err = tmp_path / f"{args[0]}-{port}.err"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args, "--port", str(port),
                                 "--shutdown-timeout", str(TIMEOUT_S), "--model", "tiny", "--threads", "1"],
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url, err


def _post(url: str, body: dict[str, Any], results: dict[str, Any], key: str, **kw: Any) -> threading.Thread:
    def run() -> None:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60, **kw)
            results[key] = (r.status_code, r.text)
        except httpx.HTTPError as exc:
            results[key] = (0, repr(exc))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _decoding(worker: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{worker}/load").json()["decoding"] < n:
        assert time.monotonic() < deadline, "the requests never started decoding"
        time.sleep(0.01)


def _exits(proc: subprocess.Popen, sent: float, within: float, code: int = 0) -> float:
    try:
        proc.wait(timeout=within + 10)
    except subprocess.TimeoutExpired:
        stop(proc, timeout=1)
        raise AssertionError(f"still running {within + 10:.0f} s after the signal") from None
    took = time.monotonic() - sent
    assert proc.returncode == code, f"exit code {proc.returncode}"
    assert took <= within, f"exited {took:.1f} s after the signal (bound {within:.1f} s)"
    return took


def _no_traceback(err: Path) -> None:
    text = err.read_text(errors="replace")
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]


@needs_engine
def test_sigterm_to_serve_finishes_short_answers_and_ends_the_rest_with_an_error(tmp_path: Path) -> None:
    proc, url, err = _start(tmp_path, "serve")
    worker = worker_of(url)
    results: dict[str, Any] = {}
    threads = [_post(url, LONG, results, "long")]
    _decoding(worker, 1)
    threads.append(_post(url, {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}, results, "short"))
    _decoding(worker, 2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _exits(proc, sent, TIMEOUT_S + 2)
    for t in threads:
        t.join(10)
    status, text = results["short"]
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 40, results["short"]
    status, text = results["long"]
    assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", results["long"]
    _no_traceback(err)
    with pytest.raises(httpx.ConnectError):  # its worker went with it
        httpx.get(f"{worker}/health")


@needs_engine
def test_sigterm_to_serve_with_an_orphaned_answer_decoding_exits_in_time(tmp_path: Path) -> None:
    proc, url, err = _start(tmp_path, "serve")
    raw = json.dumps(LONG).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:  # its client leaves once it decodes
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(raw)}\r\n\r\n".encode() + raw)
        _decoding(worker_of(url), 1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _exits(proc, sent, TIMEOUT_S + 2)
    _no_traceback(err)


@needs_engine
def test_a_second_ctrl_c_exits_at_once(tmp_path: Path) -> None:
    proc, url, err = _start(tmp_path, "serve")
    results: dict[str, Any] = {}
    thread = _post(url, LONG, results, "long")
    _decoding(worker_of(url), 1)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to serve and its workers
    time.sleep(0.5)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _exits(proc, sent, 2.0, code=130)
    thread.join(10)
    assert results["long"][0] != 200, results["long"]
    _no_traceback(err)


@needs_engine
def test_sigterm_to_a_worker_ends_its_streams_with_an_error_event(tmp_path: Path) -> None:
    proc, url, err = _start(tmp_path, "worker")
    events: list[str] = []

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG | {"stream": True}, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=read)
    thread.start()
    _decoding(url, 1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _exits(proc, sent, TIMEOUT_S + 2)
    thread.join(10)
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][6:]), events[-3:]
    _no_traceback(err)


def _slow_worker(answers: list[str]) -> Any:
    """A worker that answers /health and /load, and a completion only after 1 s ("quick") or never."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        answer: dict[str, Any] = {"status": "ok", "role": "colocated", "predicted_backlog_s": 0.0}
        if scope["path"] == "/v1/completions":
            prompt = json.loads(body)["prompt"]
            await asyncio.sleep(1.0 if prompt == "quick" else 3600)
            answers.append(prompt)
            answer = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "ok"}]}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
    return app


@pytest.mark.gateway_only
def test_sigterm_to_the_gateway_alone_drains_then_answers_503(tmp_path: Path) -> None:
    answers: list[str] = []
    with uvicorn_thread(_slow_worker(answers)) as worker_port:
        port = free_port()
        err = tmp_path / "gateway.err"
        gateway = start("gateway", "--port", str(port), "--workers", f"http://127.0.0.1:{worker_port}",
                        "--shutdown-timeout", str(TIMEOUT_S), stderr_to=err)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, gateway)
            results: dict[str, Any] = {}
            threads = [_post(url, {"prompt": p}, results, p) for p in ("quick", "stuck")]
            time.sleep(0.3)
            sent = time.monotonic()
            gateway.send_signal(signal.SIGTERM)
            _exits(gateway, sent, TIMEOUT_S + 2)
        finally:
            stop(gateway)
        for t in threads:
            t.join(10)
    assert results["quick"][0] == 200 and answers == ["quick"], results
    status, text = results["stuck"]
    assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", results["stuck"]
    _no_traceback(err)
