"""Child `flowprefill` processes and their ports: binding a port before anything is announced,
starting a child on a free port, waiting until it answers /health, passing on what it says, stopping
it. Shared by `serve`, the benchmarks that start servers, and the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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


class PortInUse(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening (connections are refused, not queued, until
    the server behind it is ready); uvicorn serves on it. Raises PortInUse (its strerror: why)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)  # as uvicorn chooses
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUse(exc.errno, os.strerror(exc.errno).lower() if exc.errno else str(exc)) from None
    sock.set_inheritable(False)
    return sock


def check_free(host: str, port: int) -> None:
    """Raises PortInUse when host:port cannot be bound now (the child that takes it binds it itself)."""
    bind(host, port).close()


def start(*args: str, env: dict[str, str] | None = None, core: int | None = None,
          quiet: bool = True, stderr_to: Path | None = None) -> subprocess.Popen:
    """`flowprefill ARGS` as a child process, optionally pinned to one CPU core; `stderr_to`: a file its
    stderr goes to (quiet or not), to say why it stopped."""
    def pin() -> None:
        if core is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})

    out = subprocess.DEVNULL if quiet else None
    with open(stderr_to, "ab") if stderr_to else contextlib.nullcontext(out) as err:
        return subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env={**os.environ, **(env or {})},
                                preexec_fn=pin if core is not None else None, stdout=out, stderr=err)


def last_line(path: Path) -> str:
    """The last non-empty line of a log (a command's one-line error, a traceback's exception)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip() if lines else "(nothing on stderr)"


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


class Relayed:
    """A child process whose stderr this one passes on, line by line, except the one-line error with
    which it refuses to start (`PREFIX: error: ...`, as the command line writes it): that is kept as
    `error`, for the parent to report in its own words. `last_line` is the last line passed on (a
    traceback's exception, when it died another way)."""

    def __init__(self, argv: list[str], error_prefix: str, cores: set[int] | None = None) -> None:
        """`cores`: the CPU cores the child may run on (Linux), set before it starts."""
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, preexec_fn=pin)
        self.error_prefix = error_prefix.encode()
        self.error: str | None = None
        self.last_line = ""
        self._relay = threading.Thread(target=self._pass_on, name=f"stderr of {argv[-1]}", daemon=True)
        self._relay.start()

    def _pass_on(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith(self.error_prefix):
                self.error = line[len(self.error_prefix):].decode(errors="replace").strip()
                continue
            text = line.decode(errors="replace")
            if text.strip():
                self.last_line = text.strip()
            # sys.stderr as it is now: while a rich status spinner runs, its proxy prints above the spinner
            with contextlib.suppress(OSError, ValueError):  # our own stderr closed: keep draining the child's
                sys.stderr.write(text)
                sys.stderr.flush()

    def cause(self) -> str:
        """Why the child is gone, in one line (call once it has exited)."""
        self._relay.join(timeout=5)  # its last words are in the pipe until the relay reads them
        return self.error or self.last_line or f"exited with code {self.proc.returncode}"


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (serve stops its workers on it), then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
