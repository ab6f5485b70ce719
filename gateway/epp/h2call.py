"""What one gRPC call sees of its HTTP/2 stream (gateway/epp/h2.py): the `Call` that serves it, and
the `Stream` it sends on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from gateway.epp.h2wire import NOT_FOUND, OK, trailers

log = logging.getLogger("flowprefill.epp")


class Sender(Protocol):
    """The connection a stream is on: what `send` and `finish` queued goes out as windows allow."""

    def flush_stream(self, stream: Stream) -> None: ...


class Call(Protocol):
    """What serves one gRPC call: its messages as they arrive, the client's end of them, a reset."""

    def message(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def cancel(self) -> None: ...


Routes = dict[str, Callable[["Stream"], Call]]  # the method's path ("/package.Service/Method") → its call


class Stream:
    """One gRPC call's HTTP/2 stream, as its `Call` sees it: `send` messages, then `finish`."""

    def __init__(self, conn: Sender, stream_id: int, send_window: int) -> None:
        self.conn, self.id = conn, stream_id
        self.send_window = send_window
        self.received = bytearray()
        self.unacked = 0  # bytes received since the last window update
        self.outbox = bytearray()
        self.headers_sent = False
        self.trailers: bytes | None = None  # set by finish: sent once the outbox is out
        self.remote_open, self.closed = True, False
        self.call: Call | None = None

    def send(self, message: bytes) -> None:
        if self.trailers is None and not self.closed:
            self.outbox += b"\x00" + len(message).to_bytes(4, "big") + message
            self.conn.flush_stream(self)

    def finish(self, code: int = OK, message: str = "") -> None:
        """End the call with its status (the trailers go after what `send` queued)."""
        if self.trailers is None and not self.closed:
            if code != OK and code != NOT_FOUND:
                log.debug("stream %d ends with gRPC status %d: %s", self.id, code, message)
            self.trailers = trailers(code, message)
            self.conn.flush_stream(self)
