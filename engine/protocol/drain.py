"""How a request that is being answered whole can end early, for the gateway's and the workers' HTTP
handlers alike: its client leaves (ASGI's `http.disconnect`), or its server shuts down and the
grace period runs out. Either way the work for it is cancelled, so that a client's timeout does
not keep an accelerator busy and a shutdown is bounded. A streamed answer notices a client that
leaves by itself (its next write); at a shutdown's deadline it ends with an error event.

Standard library only: the gateway installs without the engine (tests/test_layers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]  # an ASGI receive callable
SHUTTING_DOWN = "shutting_down"  # the OpenAI error body's code of a request ended by a shutdown
# Kubernetes' default grace period is 30 s: finish in-flight requests for up to 25 of them, leaving
# time to answer the rest with an error and exit before SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0
log = logging.getLogger("flowprefill.drain")


class ClientGone(Exception):
    """The client disconnected before its answer was ready: nobody is left to answer."""


class ShuttingDown(Exception):
    """The server's grace period ran out while the answer was being computed."""


async def disconnected(receive: Receive) -> None:
    """Returns once the client has gone. Call it only after the request's body was read: every
    message after that is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Drain:
    """A server's graceful shutdown. Once `begin` is called it takes no new requests (its /health
    answers 503) and those in flight may finish; at the deadline the work that `guard` runs is
    cancelled (ShuttingDown) and the `on_deadline` callbacks run (a worker ends its engine's
    requests with an error, which ends its streams too)."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False
        self.on_deadline: list[Callable[[], Any]] = []
        self._guarded: set[asyncio.Task[Any]] = set()

    def begin(self, timeout_s: float) -> None:
        """Start draining (call on the event loop's thread); idempotent."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: finishing the requests in flight, for up to %g s", timeout_s)
        asyncio.get_running_loop().call_later(timeout_s, self.expire)

    def expire(self) -> None:
        """The grace period is over: end what is still in flight, with an explicit error."""
        if self.expired:
            return
        self.expired = True
        if self._guarded:
            log.warning("shutting down: %d request(s) still in flight end with an error", len(self._guarded))
        for task in list(self._guarded):
            task.cancel()
        for callback in self.on_deadline:
            callback()

    async def guard(self, receive: Receive, work: Coroutine[Any, Any, T]) -> T:
        """`work`'s result, unless its client leaves first (ClientGone) or the shutdown's deadline
        passes (ShuttingDown). Either way `work` is cancelled and its clean-up has run on return."""
        task = asyncio.ensure_future(work)
        if self.expired:
            task.cancel()
        watcher = asyncio.ensure_future(disconnected(receive))
        self._guarded.add(task)
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # our own caller was cancelled: so is the work
            task.cancel()
            raise
        finally:
            watcher.cancel()
            self._guarded.discard(task)
        if task.done() and not task.cancelled():
            return task.result()
        gone = watcher.done() and not watcher.cancelled()
        if gone and watcher.exception() is not None:  # the connection broke: as good as gone
            log.debug("watching for a disconnect failed: %r", watcher.exception())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its clean-up: the engine's requests cancelled, the upstream connection closed
        if gone:
            raise ClientGone
        raise ShuttingDown
