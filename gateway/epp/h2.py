"""gRPC's server side on HTTP/2 (RFC 9113), one asyncio protocol per connection, headers by `hpack`.

Why not grpcio's server: its Python servicer hands every message between gRPC's EventEngine threads,
its poller thread and the event loop (29 context switches per ext_proc stream, `perf stat`), so a stream
that does nothing costs 0.48-0.65 ms of CPU on one core of this machine (sync or aio server, generic
handlers on raw bytes), and the picker's 2,000 picks per second need 0.5 ms in all. The `h2` package
(pure Python, its state machine per frame) cost 0.62 ms for the same stream. This module keeps what a
gRPC stream needs and no more: frames parsed with `struct`, HPACK decoding by the `hpack` package
(the dynamic table and Huffman codes that the data plane's encoder uses), our own headers sent as
literals that never touch a dynamic table, flow control both ways, and one write per batch of frames
read: 0.24 ms of CPU a pick in all (docs/benchmarks.md, "Endpoint picker").

What it serves: gRPC calls of any arity to the paths it is given (`Routes`), length-prefixed messages
without compression (the data plane's ext_proc and health clients send none), status in trailers,
PING, SETTINGS, GOAWAY both ways (a graceful stop lets open streams finish), RST_STREAM both ways.
It is not a general HTTP/2 server: no server push, no priorities, no request trailers beyond ending
the stream.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Protocol, cast

import hpack

from gateway.epp import h2wire as wire
from gateway.epp.h2call import Routes, Stream
from gateway.epp.h2out import DRAIN_PING, FramesOut
from gateway.epp.h2wire import HeaderDecoder, frame

log = logging.getLogger("flowprefill.epp")


class Listener(Protocol):
    """The server a connection belongs to (gateway/epp/grpc_server.py)."""

    connections: set[Connection]

    def wake(self) -> None: ...


MAX_WINDOW = 0x7FFFFFFF  # a flow-control window's largest size (RFC 9113 6.9.1)


class H2Error(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with `code`, and the connection closes."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Connection(FramesOut, asyncio.Protocol):
    """One client connection: frames in, calls dispatched, frames out in one write per read
    (`FramesOut`, gateway/epp/h2out.py)."""

    def __init__(self, routes: Routes, max_message: int, server: Listener) -> None:
        self.routes, self.max_message, self.server = routes, max_message, server
        self.decoder = HeaderDecoder(wire.MAX_HEADER_LIST)
        self.buffer = bytearray()
        self.out = bytearray()
        self.streams: dict[int, Stream] = {}
        self.blocked: dict[int, Stream] = {}  # streams with bytes waiting for a window
        self.last_id = 0
        self.send_window, self.peer_initial, self.peer_max_frame = wire.DEFAULT_WINDOW, wire.DEFAULT_WINDOW, 16_384
        self.unacked = 0
        self.table_changed = False
        self.preface_seen = False
        self.continuing: tuple[int, int, bytearray] | None = None  # stream, flags, block so far
        self.going_away = False  # the last GOAWAY sent: new streams are refused
        self.draining = False  # the first GOAWAY sent
        self.transport: asyncio.Transport | None = None
        self.reading = False  # inside data_received: frames go out in one write at its end

    # --- asyncio -----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without the base class
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # asyncio sets it only on sockets made with proto IPPROTO_TCP, not on ours
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else Nagle holds an answer 40 ms
        self.server.connections.add(self)
        settings = struct.pack(">HIHIHIHI", wire.MAX_CONCURRENT, wire.MAX_STREAMS,
                               wire.INITIAL_WINDOW, wire.RECEIVE_WINDOW,
                               wire.MAX_FRAME, wire.MAX_FRAME_SIZE, wire.HEADER_TABLE_SIZE, 4096)
        self.out += frame(wire.SETTINGS, 0, 0, settings)
        self.out += frame(wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 16 * wire.RECEIVE_WINDOW))
        self._write()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.reading = True
        try:
            if not self.preface_seen:
                if len(self.buffer) < len(wire.PREFACE):
                    return
                if self.buffer[:len(wire.PREFACE)] != wire.PREFACE:
                    raise H2Error(wire.PROTOCOL_ERROR, "not an HTTP/2 client (gRPC needs HTTP/2)")
                del self.buffer[:len(wire.PREFACE)]
                self.preface_seen = True
            self._frames()
        except H2Error as exc:
            log.debug("HTTP/2 connection error %d: %s", exc.code, exc)
            self.out += frame(wire.GOAWAY, 0, 0, struct.pack(">II", self.last_id, exc.code) + str(exc).encode())
            self._write()
            self._abort_streams()
            if self.transport is not None:
                self.transport.close()
        finally:
            self.reading = False
        self._write()

    def connection_lost(self, exc: Exception | None) -> None:
        self._abort_streams()
        self.server.connections.discard(self)
        self.server.wake()

    # --- frames in ---------------------------------------------------------------------------------
    def _frames(self) -> None:
        buf, at, n = self.buffer, 0, len(self.buffer)
        while n - at >= 9:
            head, flags, sid = wire.FRAME_HEADER.unpack_from(buf, at)
            length, kind, sid = head >> 8, head & 0xFF, sid & 0x7FFFFFFF
            if length > wire.MAX_FRAME_SIZE:
                raise H2Error(wire.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if n - at < 9 + length:
                break
            payload = bytes(buf[at + 9:at + 9 + length])
            at += 9 + length
            if self.continuing is not None and kind != wire.CONTINUATION:
                raise H2Error(wire.PROTOCOL_ERROR, "a header block interrupted")
            self._frame(kind, flags, sid, payload)
        del buf[:at]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == wire.DATA:
            self._data(flags, sid, payload)
        elif kind == wire.HEADERS:
            self._headers_frame(flags, sid, payload)
        elif kind == wire.CONTINUATION:
            if self.continuing is None or self.continuing[0] != sid:
                raise H2Error(wire.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self.continuing[2].extend(payload)
            if len(self.continuing[2]) > wire.MAX_HEADER_LIST:  # an endless header block (CVE-2024-27316's kind)
                raise H2Error(wire.PROTOCOL_ERROR, f"a header block over {wire.MAX_HEADER_LIST} bytes")
            if flags & wire.END_HEADERS:
                sid, first_flags, block = self.continuing
                self.continuing = None
                self._header_block(sid, first_flags, bytes(block))
        elif kind == wire.SETTINGS:
            if not flags & wire.ACK:
                self._settings(payload)
        elif kind == wire.PING:
            self._ping(flags, payload)
        elif kind == wire.WINDOW_UPDATE:
            if len(payload) != 4:
                raise H2Error(wire.FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame not of 4 bytes")
            self._window_update(sid, payload)
        elif kind == wire.RST_STREAM:
            if len(payload) != 4:
                raise H2Error(wire.FRAME_SIZE_ERROR, "a RST_STREAM frame not of 4 bytes")
            stream = self.streams.get(sid)
            if stream is not None:
                self._close(stream, cancelled=True)
        elif kind == wire.GOAWAY:
            self.going_away = True
        elif kind == wire.PUSH_PROMISE:
            raise H2Error(wire.PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown types: ignored, as RFC 9113 lets a server do

    def _ping(self, flags: int, payload: bytes) -> None:
        if len(payload) != 8:
            raise H2Error(wire.FRAME_SIZE_ERROR, "a PING frame not of 8 bytes")
        if not flags & wire.ACK:
            self.out += frame(wire.PING, wire.ACK, 0, payload)
        elif payload == DRAIN_PING:
            self._last_goaway()

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if flags & wire.PADDED:
            pad = payload[0] if payload else 0
            if pad >= len(payload):
                raise H2Error(wire.PROTOCOL_ERROR, "padding longer than its frame")
            return payload[1:len(payload) - pad]
        return payload

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise H2Error(wire.FRAME_SIZE_ERROR, "a SETTINGS frame of a wrong size")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == wire.INITIAL_WINDOW:
                if value > MAX_WINDOW:
                    raise H2Error(wire.FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta, self.peer_initial = value - self.peer_initial, value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:  # RFC 9113 6.9.2: a connection error
                        raise H2Error(wire.FLOW_CONTROL_ERROR, "an initial window that takes a stream's past 2^31-1")
            elif key == wire.MAX_FRAME:
                if not 16_384 <= value <= 16_777_215:
                    raise H2Error(wire.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} (RFC 9113: 2^14 to 2^24-1)")
                self.peer_max_frame = value
            elif key == wire.HEADER_TABLE_SIZE:
                self.table_changed = True  # our next block says so (ours stays empty: size 0)
        self.out += frame(wire.SETTINGS, wire.ACK, 0)
        self._flush_blocked()

    def _window_update(self, sid: int, payload: bytes) -> None:
        """RFC 9113 6.9: an increment of 0 is a PROTOCOL_ERROR, a window past 2^31-1 a FLOW_CONTROL_ERROR,
        of the connection on stream 0, else of the stream alone (reset; the connection goes on)."""
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise H2Error(wire.PROTOCOL_ERROR, "a window update of 0")
            if self.send_window + increment > MAX_WINDOW:
                raise H2Error(wire.FLOW_CONTROL_ERROR, "a window update past 2^31-1")
            self.send_window += increment
            self._flush_blocked()
            return
        stream = self.streams.get(sid)
        if stream is None:
            return
        if increment == 0 or stream.send_window + increment > MAX_WINDOW:
            self.out += frame(wire.RST_STREAM, 0, sid, struct.pack(
                ">I", wire.PROTOCOL_ERROR if increment == 0 else wire.FLOW_CONTROL_ERROR))
            self._close(stream, cancelled=True)
            return
        stream.send_window += increment
        self.flush_stream(stream)

    # --- streams in --------------------------------------------------------------------------------
    def _headers_frame(self, flags: int, sid: int, payload: bytes) -> None:
        payload = self._unpad(flags, payload)
        if flags & wire.PRIORITY_FLAG:
            payload = payload[5:]
        if flags & wire.END_HEADERS:
            self._header_block(sid, flags, payload)
        else:
            self.continuing = (sid, flags, bytearray(payload))

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self.decoder.decode(block)
        except hpack.HPACKError as exc:
            raise H2Error(wire.COMPRESSION_ERROR, f"a header block: {exc}") from None
        stream = self.streams.get(sid)
        if stream is not None:  # the client's trailers: only the end of its messages matters
            if flags & wire.END_STREAM:
                self._remote_end(stream)
            return
        if sid % 2 == 0 or sid <= self.last_id:
            if sid % 2 == 0:
                raise H2Error(wire.PROTOCOL_ERROR, f"stream {sid}: a client opens odd streams")
            self.out += frame(wire.RST_STREAM, 0, sid, struct.pack(">I", 5))  # STREAM_CLOSED
            return
        self.last_id = sid
        if self.going_away or len(self.streams) >= wire.MAX_STREAMS:
            self.out += frame(wire.RST_STREAM, 0, sid, struct.pack(">I", wire.REFUSED_STREAM))
            return
        stream = Stream(self, sid, self.peer_initial)
        self.streams[sid] = stream
        stream.remote_open = not flags & wire.END_STREAM
        self._open(stream, headers)
        if not stream.remote_open and not stream.closed:
            self._remote_end(stream)

    def _open(self, stream: Stream, headers: dict[bytes, bytes]) -> None:
        path = headers.get(b":path", b"").decode("latin-1")
        route = self.routes.get(path)
        if headers.get(b":method") != b"POST" or not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            stream.finish(wire.UNIMPLEMENTED, "gRPC calls are POSTs of application/grpc")
        elif route is None:
            stream.finish(wire.UNIMPLEMENTED, f"no method {path}")
        elif headers.get(b"grpc-encoding", b"identity") != b"identity":
            stream.finish(wire.UNIMPLEMENTED, "message compression is not supported: send identity")
        else:
            try:
                stream.call = route(stream)
            except Exception:  # a bug of ours: this call fails, the connection goes on
                log.exception("opening the gRPC call %s on stream %d failed", path, stream.id)
                stream.finish(wire.INTERNAL, "the endpoint picker failed on this call (its log says why)")

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        self.unacked += len(payload)  # padding included: all of it counts against the window
        if self.unacked >= wire.RECEIVE_WINDOW:
            self.out += frame(wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacked))
            self.unacked = 0
        stream = self.streams.get(sid)
        if stream is None or not stream.remote_open:
            return  # a stream we ended (its late data) or reset
        if flags & wire.END_STREAM:
            stream.remote_open = False  # known before the call answers: no reset after its trailers
        if stream.trailers is not None:
            return  # the call is over, its trailers wait for a window: what else comes is dropped
        stream.unacked += len(payload)
        if stream.unacked >= wire.RECEIVE_WINDOW // 2 and not flags & wire.END_STREAM:
            self.out += frame(wire.WINDOW_UPDATE, 0, sid, struct.pack(">I", stream.unacked))
            stream.unacked = 0
        stream.received += self._unpad(flags, payload)
        self._messages(stream)
        if flags & wire.END_STREAM and sid in self.streams:
            self._remote_end(stream)

    def _messages(self, stream: Stream) -> None:
        got = stream.received
        while len(got) >= 5 and stream.call is not None and stream.trailers is None:
            size = int.from_bytes(got[1:5], "big")
            if got[0] != 0:
                return self._fail(stream, wire.UNIMPLEMENTED, "a compressed message: send identity")
            if size > self.max_message:
                return self._fail(stream, wire.RESOURCE_EXHAUSTED,
                                  f"a message of {size} bytes, over the limit of {self.max_message}")
            if len(got) < 5 + size:
                return
            message = bytes(got[5:5 + size])
            del got[:5 + size]
            self._dispatch(stream, stream.call.message, message)

    def _dispatch(self, stream: Stream, handler: Callable[..., None], *args: bytes) -> None:
        try:
            handler(*args)
        except Exception:  # a bug of ours: the call fails, the connection and its other calls go on
            log.exception("the gRPC call on stream %d failed", stream.id)
            if handler.__name__ != "cancel":
                self._fail(stream, wire.INTERNAL, "the endpoint picker failed on this call (its log says why)")

    def _fail(self, stream: Stream, code: int, message: str) -> None:
        """End a call that the transport (or its own failure) cut short: its `cancel` returns what it holds."""
        stream.finish(code, message)
        if stream.call is not None:
            call, stream.call = stream.call, None
            self._dispatch(stream, call.cancel)

    def _remote_end(self, stream: Stream) -> None:
        stream.remote_open = False
        if stream.received and stream.trailers is None:
            self._fail(stream, wire.INTERNAL, "the stream ended inside a message")
        if stream.call is not None and stream.trailers is None:
            self._dispatch(stream, stream.call.end)

    # --- streams closed ----------------------------------------------------------------------------
    def _close(self, stream: Stream, cancelled: bool) -> None:
        stream.closed = True
        self.streams.pop(stream.id, None)
        self.blocked.pop(stream.id, None)
        if cancelled and stream.call is not None:  # a call that finished is no longer in `streams`
            self._dispatch(stream, stream.call.cancel)
        if not self.streams:
            self.server.wake()

    def _abort_streams(self) -> None:
        for stream in list(self.streams.values()):
            self._close(stream, cancelled=True)
