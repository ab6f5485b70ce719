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
