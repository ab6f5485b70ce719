"""Child `flowprefill` processes: starting one on a free port, waiting until it answers /health,
stopping it. Shared by `serve`, the benchmarks that start servers, and the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx


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


def start(*args: str, env: dict[str, str] | None = None, core: int | None = None,
          quiet: bool = True) -> subprocess.Popen:
    """`flowprefill ARGS` as a child process, optionally pinned to one CPU core."""
    def pin() -> None:
        if core is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})

    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env={**os.environ, **(env or {})},
                            preexec_fn=pin if core is not None else None, stdout=out, stderr=out)


def healthy(url: str) -> bool:
    """The process answers /health (serve starts its gateway only once its workers answer)."""
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def answers(url: str) -> bool:
    """The process answers /health at all (a gateway with no healthy worker answers 503)."""
    try:
        httpx.get(f"{url}/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180, *,
                 ready: Callable[[str], bool] = healthy) -> None:
    """Until `ready(url)` (by default: /health answers 200). Raises RuntimeError if the process exits
    first, TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process for {url} exited with code {proc.returncode}")
        if ready(url):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout:g} s")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (serve stops its workers on it), then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
