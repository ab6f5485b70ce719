"""A gRPC connection's frames out (a part of gateway/epp/h2.py's `Connection`): a stream's messages as
DATA frames as far as both flow-control windows allow, its headers and trailers, one write per read, the
graceful stop's two GOAWAYs, and asyncio's write flow control."""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING

from gateway.epp import h2wire as wire
from gateway.epp.h2call import Stream
from gateway.epp.h2wire import frame

DRAIN_PING = b"draining"  # the PING of a graceful stop's first GOAWAY
DRAIN_S = 1.0  # at most this long between the two GOAWAYs


class FramesOut:
    """What a connection sends (a part of `Connection`)."""

    # The connection's state these methods use (gateway/epp/h2.py's Connection sets it up), and its
    # `_close` (a stream forgotten).
    out: bytearray
    transport: asyncio.Transport | None
    reading: bool
    blocked: dict[int, Stream]
    send_window: int
    peer_max_frame: int
    table_changed: bool
    last_id: int
    going_away: bool
    draining: bool

    if TYPE_CHECKING:
        def _close(self, stream: Stream, cancelled: bool) -> None: ...

    def flush_stream(self, stream: Stream) -> None:
        """Send what `stream` has queued as far as the windows allow; its trailers once all is out."""
        if stream.closed:
            return
        box = stream.outbox
        if not stream.headers_sent:
            stream.headers_sent = True
            if not box and stream.trailers is not None:  # trailers only: one HEADERS frame
                self._header_frame(stream.id, wire.RESPONSE_HEADERS + stream.trailers, end=True)
                return self._settle(stream)
            self._header_frame(stream.id, wire.RESPONSE_HEADERS, end=False)
        while box and self.send_window > 0 and stream.send_window > 0:
            n = min(len(box), self.send_window, stream.send_window, self.peer_max_frame)
            self.out += frame(wire.DATA, 0, stream.id, bytes(box[:n]))
            del box[:n]
            self.send_window -= n
            stream.send_window -= n
        if box:
            self.blocked[stream.id] = stream
        else:
            self.blocked.pop(stream.id, None)
            if stream.trailers is not None:
                self._header_frame(stream.id, stream.trailers, end=True)
                return self._settle(stream)
        if not self.reading:
            self._write()  # sent from outside a read (a health watch's update): out now

    def _header_frame(self, sid: int, block: bytes, end: bool) -> None:
        if self.table_changed:
            block, self.table_changed = b"\x20" + block, False  # a table size update to 0 (RFC 7541 6.3)
        flags = wire.END_HEADERS | (wire.END_STREAM if end else 0)
        self.out += frame(wire.HEADERS, flags, sid, block)  # ours are small: one frame

    def _flush_blocked(self) -> None:
        for stream in list(self.blocked.values()):
            self.flush_stream(stream)

    def _settle(self, stream: Stream) -> None:
        """The call's trailers are out: forget its stream (reset, if the client still sends on it)."""
        if stream.remote_open:
            self.out += frame(wire.RST_STREAM, 0, stream.id, struct.pack(">I", wire.NO_ERROR))
        self._close(stream, cancelled=False)
        if not self.reading:
            self._write()

    def _write(self) -> None:
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(bytes(self.out))
        self.out.clear()

    def go_away(self) -> None:
        """A graceful stop: no new streams; the open ones may finish. In two steps (RFC 9113 6.8, as
        grpc's servers do): a GOAWAY that still admits every stream, with a PING; once the PING comes
        back (or after a second), the GOAWAY with the last stream taken. A stream the client opened
        before it read the first is served, not refused (a data plane need not retry it)."""
        if self.draining or self.transport is None:
            return
        self.draining = True
        self.out += frame(wire.GOAWAY, 0, 0, struct.pack(">II", 0x7FFFFFFF, wire.NO_ERROR))
        self.out += frame(wire.PING, 0, 0, DRAIN_PING)
        self._write()
        asyncio.get_running_loop().call_later(DRAIN_S, self._last_goaway)

    def _last_goaway(self) -> None:
        if self.going_away or self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self.out += frame(wire.GOAWAY, 0, 0, struct.pack(">II", self.last_id, wire.NO_ERROR))
        if not self.reading:
            self._write()

    # asyncio's write flow control: a peer that stops reading is not read from either (it could
    # otherwise have us queue PING and SETTINGS acknowledgements without bound)
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()
