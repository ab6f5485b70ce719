"""Upstream workers: health, load, and the choice of where a request goes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import httpx

log = logging.getLogger("flowprefill.gateway")


class Worker:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = True
        self.in_flight = 0
        self.backlog_s = 0.0  # predicted prefill work queued there (its /load)
        self.down_until = 0.0

    def __repr__(self) -> str:
        return f"Worker({self.url}, healthy={self.healthy}, in_flight={self.in_flight})"


class WorkerPool:
    """SLO-aware routing: least predicted backlog (the worker's own /load plus what this gateway
    has in flight there), round robin among equals; a failing worker leaves rotation until its
    health check passes again."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient, poll_s: float = 1.0,
                 per_request_s: float = 0.05) -> None:
        if not urls:
            raise ValueError("the gateway needs at least one worker URL")
        self.workers = [Worker(u) for u in urls]
        self.client, self.poll_s, self.per_request_s = client, poll_s, per_request_s
        self._rr = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def pick(self, exclude: frozenset[str] | set[str] = frozenset()) -> Worker | None:
        now = time.monotonic()
        live = [w for w in self.workers if w.url not in exclude and w.healthy and w.down_until <= now]
        if not live:
            return None
        start = next(self._rr)
        ranked = sorted(range(len(live)), key=lambda i: (self._score(live[i]), (i - start) % len(live)))
        return live[ranked[0]]

    def _score(self, w: Worker) -> float:
        return w.backlog_s + w.in_flight * self.per_request_s

    def mark_failed(self, w: Worker, cooldown_s: float = 2.0) -> None:
        log.warning("worker %s failed; out of rotation", w.url)
        w.healthy = False
        w.down_until = time.monotonic() + cooldown_s

    async def poll_once(self) -> None:
        async def check(w: Worker) -> None:
            try:
                r = await self.client.get(f"{w.url}/load", timeout=2.0)
                r.raise_for_status()
                w.backlog_s = float(r.json().get("predicted_backlog_s", 0.0))
                if not w.healthy and time.monotonic() >= w.down_until:
                    log.info("worker %s healthy again", w.url)
                w.healthy = time.monotonic() >= w.down_until
            except (httpx.HTTPError, ValueError):
                w.healthy = False

        await asyncio.gather(*(check(w) for w in self.workers))

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
