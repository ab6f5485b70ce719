"""Starting and stopping `flowprefill` processes on free local ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def free_port(span: int = 1) -> int:
    """A port P with P .. P+span-1 all free (serve puts its workers on the ports after its own)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for p in range(port + 1, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process for {url} exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`flowprefill ARGS` as a child process (output discarded)."""
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env={**ENV, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def preemption_scenario(url: str, trace_id: str | None = None) -> dict[str, httpx.Response]:
    """A long `batch` request whose prefill three `interactive` requests arrive during: under
    flowprefill they preempt it. Returns the responses by request id."""
    import threading

    results: dict[str, httpx.Response] = {}

    def send(rid: str, cls: str, n: int) -> None:
        headers = {"x-slo-class": cls, "x-request-id": rid}
        if trace_id:
            headers["traceparent"] = f"00-{trace_id}-{rid.encode().hex()[-16:].rjust(16, '0')}-01"
        results[rid] = httpx.post(f"{url}/v1/completions", timeout=120, headers=headers,
                                  json={"prompt": [(7 * i) % 500 for i in range(n)], "max_tokens": 2,
                                        "temperature": 0})

    threads = [threading.Thread(target=send, args=("long-batch", "batch", 12000))]
    threads[0].start()
    time.sleep(0.3)  # its prefill is under way
    for i in range(3):
        threads.append(threading.Thread(target=send, args=(f"chat-{i}", "interactive", 64)))
        threads[-1].start()
        time.sleep(0.08)
    for t in threads:
        t.join()
    return results
