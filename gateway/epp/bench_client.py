"""`flowprefill bench epp`'s second client: ext_proc streams as frames written by hand on one HTTP/2
connection, so that what the measurement adds is small next to what the picker adds.

Envoy's ext_proc client is C++; grpc's Python client (gateway/epp/client.py) spends about 0.6 ms of
its own per stream here, more than the picker does, so latency through it is an upper bound. This
one encodes a stream's headers with `hpack` (the same dynamic table the picker decodes against),
writes each phase's messages in one DATA frame and counts the answers' gRPC envelopes as they come:
no per-message objects, no threads. It is a measuring tool, not a client to build on: no TLS, no
flow control beyond windows too large to run out in a benchmark, no error handling beyond failing.
"""

from __future__ import annotations

import asyncio
import struct

import hpack

from gateway.epp.h2wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    split_frames,
)

WINDOW = (1 << 31) - 1  # ours, for every stream and the connection: the picker never waits for us
PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class _Call:
    def __init__(self) -> None:
        self.pending = bytearray()
        self.answers = 0
        self.want = 0
        self.ready = asyncio.Event()
        self.ended = False

    def data(self, payload: bytes) -> None:
        self.pending += payload
        while len(self.pending) >= 5 and len(self.pending) >= 5 + int.from_bytes(self.pending[1:5], "big"):
            del self.pending[:5 + int.from_bytes(self.pending[1:5], "big")]
            self.answers += 1
        self.ready.set()


class RawClient:
    """One connection; `phase` sends a stream's next messages and waits for its answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.calls: dict[int, _Call] = {}
        self.next_id = 1
        self.consumed = 0
        self.failed: str | None = None
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, address: str) -> RawClient:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW, WINDOW)) +
                     frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", WINDOW - 65_535)))
        return cls(reader, writer)

    def open(self, headers: list[tuple[str, str]]) -> int:
        sid, self.next_id = self.next_id, self.next_id + 2
        self.calls[sid] = _Call()
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", PATH),
                                     (":authority", "epp"), ("te", "trailers"),
                                     ("content-type", "application/grpc"), *headers])
        self.writer.write(frame(HEADERS, END_HEADERS, sid, block))
        return sid

    async def phase(self, sid: int, messages: list[bytes], answers: int, end: bool = False) -> None:
        """Send `messages` (serialised), a DATA frame each, in one write, on stream `sid`; return once
        it has `answers` answers in all (and, with `end`, after ending the stream, its trailers)."""
        call = self.calls[sid]
        call.want = answers
        self.writer.write(b"".join(frame(DATA, 0, sid, b"\x00" + len(m).to_bytes(4, "big") + m) for m in messages)
                          + (frame(DATA, END_STREAM, sid) if end else b""))
        while call.answers < answers or (end and not call.ended):
            call.ready.clear()
            await call.ready.wait()
            if self.failed is not None:
                raise RuntimeError(f"the picker's connection failed: {self.failed}")
        if end:
            del self.calls[sid]

    async def _read(self) -> None:
        try:
            await self._frames()
        except Exception as exc:  # every waiting phase hears of it
            self.failed = repr(exc)
        else:
            self.failed = "closed by the picker"
        for call in self.calls.values():
            call.ready.set()

    async def _frames(self) -> None:
        buf = b""
        while True:
            chunk = await self.reader.read(1 << 16)
            if not chunk:
                return
            frames, buf = split_frames(buf + chunk)
            for kind, flags, sid, payload in frames:
                self._frame(kind, flags, sid, payload)

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        call = self.calls.get(sid)
        if kind == DATA and call is not None:
            self.consumed += len(payload)
            if self.consumed > WINDOW // 2:  # never in a benchmark's life, but correct if it comes
                self.writer.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.consumed)))
                self.consumed = 0
            call.data(payload)
        elif kind == HEADERS and call is not None and flags & END_STREAM:  # trailers (a stream's end)
            call.ended = True
            call.ready.set()
        elif kind == SETTINGS and not flags & ACK:
            self.writer.write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.writer.write(frame(PING, ACK, 0, payload))
        elif kind in (RST_STREAM, GOAWAY):
            raise RuntimeError(f"the picker sent {'RST_STREAM' if kind == RST_STREAM else 'GOAWAY'}")

    async def close(self) -> None:
        self._reading.cancel()
        self.writer.close()
