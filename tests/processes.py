"""Starting and stopping `flowprefill` processes on free local ports (gateway/processes.py), plus a
scenario several tests share."""

from __future__ import annotations

import importlib.util
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.processes import answers, free_port, start, stop, wait_healthy

__all__ = ["HEAVY", "answers", "asgi_body", "free_port", "mapped_heavy", "needs_engine", "preemption_scenario",
           "serving", "start", "stop", "uvicorn_thread", "wait_healthy", "worker_of"]

# A test of a gateway-only module (tests/conftest.py) that starts an engine worker: skipped where only
# the base install is (.ci/run's gateway venv), which has no torch.
needs_engine = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                  reason="starts an engine worker: needs the engine extra")
# What the gateway's processes never load: the engine's native code, the load generator's, the plots'.
HEAVY = ("torch", "numpy", "tokenizers", "safetensors", "llguidance", "locust", "matplotlib", "transformers")


def mapped_heavy(pid: int) -> tuple[list[str], set[str]]:
    """The shared objects of HEAVY packages a running process has mapped (Linux: /proc/PID/maps), and
    all it has mapped: a package's native code is there once it is imported."""
    libraries = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if ".so" in line}
    return [lib for lib in libraries if any(f"/{p}/" in lib or f"/{p}." in lib for p in HEAVY)], libraries


async def asgi_body(receive: Any) -> bytes:
    """The whole request body an ASGI app receives."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


@contextmanager
def uvicorn_thread(app: Any, **config: Any) -> Iterator[int]:
    """An ASGI app served by uvicorn in a thread of this process (keep-alive 1 s): its port. On exit a
    request still open is cancelled after 1 s (uvicorn would wait for it forever, and the join 10 s)."""
    import uvicorn

    port = free_port()
    config = {"timeout_keep_alive": 1, "timeout_graceful_shutdown": 1} | config
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`flowprefill serve` (gateway + one worker, one torch thread) on free ports, on the tiny model unless
    `args` say another --model: its URL.
    Stopped on exit; the no-orphans check is the caller's (the worker is on the next port)."""
    port = free_port(span=2)
    proc = start("serve", "--model", "tiny", "--port", str(port), "--kv-capacity-tokens", "65536", "--threads", "1",
                 *args, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)


def preemption_scenario(url: str, trace_id: str | None = None) -> dict[str, httpx.Response]:
    """A long `batch` request whose prefill three `interactive` requests arrive during: under
    flowprefill they preempt it. Returns the responses by request id. The long one asks for a 60 s
    target (at batch's priority, as docs/observability.md's recipe does): with batch's 6 s, a busy
    machine's prediction for 12,000 tokens can pass 6 s, and the worker sheds it (429)."""
    results: dict[str, httpx.Response] = {}

    def send(rid: str, cls: str, n: int) -> None:
        headers = {"x-request-id": rid} | ({"x-slo-ttft-ms": "60000"} if cls == "batch" else {"x-slo-class": cls})
        if trace_id:
            headers["traceparent"] = f"00-{trace_id}-{rid.encode().hex()[-16:].rjust(16, '0')}-01"
        results[rid] = httpx.post(f"{url}/v1/completions", timeout=120, headers=headers,
                                  json={"prompt": [(7 * i) % 500 for i in range(n)], "max_tokens": 2,
                                        "temperature": 0})

    threads = [threading.Thread(target=send, args=("long-batch", "batch", 12000))]
    threads[0].start()
    prefilling(worker_of(url))
    for i in range(3):
        threads.append(threading.Thread(target=send, args=(f"chat-{i}", "interactive", 64)))
        threads[-1].start()
        time.sleep(0.08)
    for t in threads:
        t.join()
    return results


def worker_of(url: str) -> str:
    """The worker behind `flowprefill serve`'s gateway at `url`: it listens on the next port."""
    base, port = url.rsplit(":", 1)
    return f"{base}:{int(port) + 1}"


def prefilling(worker: str, timeout: float = 60) -> None:
    """Wait until the worker's only request has left the queue for a formed prefill batch (GET /load).
    A fixed 0.3 s wait was not enough on a loaded CI machine: the urgent requests arrived before the
    long one and nothing was preempted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = httpx.get(f"{worker}/load", timeout=10).json()
        if load["waiting"] == 0 and load["predicted_backlog_s"] > 0:
            time.sleep(0.1)  # past its first operators: 12,000 tokens take seconds more
            return
        time.sleep(0.02)
    raise AssertionError(f"the long request never started its prefill: {load}")


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`flowprefill ARGS` run by its entry point in this process, as `flowprefill` would exit: a
    refusal's exit status and output without 3-4 s of interpreter and torch start-up per case (tests
    of what starts servers or workers keep real processes)."""
    from gateway.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["flowprefill", *args], code, out, err)
