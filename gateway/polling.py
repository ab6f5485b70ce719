"""Keeping a pool's view of its workers current (a part of `WorkerPool`, gateway/routing.py): a health
check of each worker every `poll_s`, by its /load (a flowprefill worker: its predicted backlog and role)
or its health path (a plain OpenAI server), and the DNS sources looked up again on their own task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

import httpx

from gateway.config import Upstream
from gateway.discovery import Discovery

if TYPE_CHECKING:
    from gateway.routing import Worker

log = logging.getLogger("flowprefill.gateway")


class WorkerPolling:
    """Health checks and load polls, and the tasks that run them (a part of `WorkerPool`)."""

    # The pool's state these methods use (gateway/routing.py's WorkerPool sets it up), and its
    # `discover` (members from DNS) and `_dispatch` (free slots to waiters).
    workers: list[Worker]
    client: httpx.AsyncClient
    poll_s: float
    upstream: Upstream
    gated: bool
    roles: frozenset[str]
    discovery: Discovery | None
    _tasks: list[asyncio.Task[None]]

    if TYPE_CHECKING:
        async def discover(self) -> None: ...
        def _dispatch(self) -> None: ...

    async def poll_once(self) -> None:
        if self.discovery is not None and not self.discovery.resolved:
            await self.discover()  # the first time: find the members before checking them
        await asyncio.gather(*(self._check(w) for w in self.workers))
        if self.gated:
            self._dispatch()  # a worker back in rotation has free slots

    async def _check(self, w: Worker) -> None:
        """One health check: in rotation when it passes (and a failure's cool-down is over); each
        reason it fails for is logged once until it passes again (a worker whose answer flaps between
        two reasons, polled every second, would otherwise log every poll), and so is the recovery."""
        probe = self._probe_server if self.gated else self._probe_load
        try:
            try:
                problem = await probe(w)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # The server closed the pooled connection as it was reused (its keep-alive ran out
                # with the poll: seen as a protocol error or as ECONNRESET): once more, on a new one.
                problem = await probe(w)
        except httpx.HTTPError as exc:
            problem = _unreachable(exc)
        except ValueError:
            problem = "GET /load answered something that is not JSON: is it a flowprefill worker?"
        if problem is not None:
            if problem not in w.problems_logged:
                log.warning("worker %s unhealthy: %s", w.url, problem)
                w.problems_logged.add(problem)
            w.healthy = False
            return
        w.problems_logged.clear()
        if not w.healthy and time.monotonic() >= w.down_until:
            log.info("worker %s %s", w.url, "healthy again" if w.checked else "healthy: in rotation")
        w.healthy = time.monotonic() >= w.down_until
        w.checked = True

    async def _probe_server(self, w: Worker) -> str | None:
        """A plain OpenAI server: alive or not."""
        path = self.upstream.health_path
        r = await self.client.get(f"{w.url}{path}", timeout=2.0)
        return None if r.is_success else f"GET {path} answered {r.status_code}"

    async def _probe_load(self, w: Worker) -> str | None:
        """A flowprefill worker: its /load gives its predicted backlog and its role."""
        r = await self.client.get(f"{w.url}/load", timeout=2.0)
        if r.status_code == 404:
            return "GET /load answered 404: a plain OpenAI server? use --upstream openai"
        if not r.is_success:
            return f"GET /load answered {r.status_code}"
        load = r.json()
        w.backlog_s = float(load.get("predicted_backlog_s", 0.0))
        by_class = load.get("predicted_backlog_by_class_s")
        w.backlog_by_class = {str(k): float(v) for k, v in by_class.items()} if isinstance(by_class, dict) else {}
        w.role = str(load.get("role", "colocated"))
        if w.role not in self.roles:
            return (f"it has role {w.role!r}, but it is listed where {' or '.join(sorted(self.roles))} is needed: "
                    "not routing to it")
        return None

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

    async def _resolve_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.discover()
            except Exception:  # a bug here must not stop discovery for good: say it, try again later
                log.exception("worker discovery failed")

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop())]
        if self.discovery is not None:
            self._tasks.append(loop.create_task(self._resolve_loop(self.discovery.interval_s)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _unreachable(exc: httpx.HTTPError) -> str:
    """Why a health check got no answer, in a few words."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "unreachable (connect timed out)"
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc  # the OSError underneath: ECONNREFUSED, a DNS failure
        while cause is not None and not (isinstance(cause, OSError) and cause.errno):
            cause = cause.__cause__ or cause.__context__
        if not isinstance(cause, OSError):
            return f"unreachable ({exc})"
        # asyncio words ECONNREFUSED "Connect call failed (...)"; the errno's own words are clearer
        reason = os.strerror(cause.errno) if cause.errno > 0 else str(cause.strerror)
        return f"unreachable ({reason.lower()})"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer to its health check in 2 s"
    return f"health check failed ({type(exc).__name__}: {exc})"
