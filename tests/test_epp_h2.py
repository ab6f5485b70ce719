"""The endpoint picker's own gRPC transport (gateway/epp/h2.py, gateway/epp/grpc_server.py), frame by
frame: a real HTTP/2 client (the `h2` package, as hyper, httpx and hypercorn use it) on a socket
to a running server, for what grpc's client never does on its own (tiny windows, padding, CONTINUATION,
resets, compressed or oversized messages, a graceful stop with a call open). tests/test_epp.py drives
the same server with grpc's own client."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("envoy.service.ext_proc.v3", reason="needs the epp extra (xds-protos)")
pytest.importorskip("h2", reason="needs h2 (the test extra)")

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.grpc_server import NOT_SERVING, SERVING, GrpcServer, Health
from gateway.epp.h2call import Stream
from gateway.epp.h2wire import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RESOURCE_EXHAUSTED,
    RST_STREAM,
    SETTINGS,
    UNIMPLEMENTED,
    WINDOW_UPDATE,
    HeaderDecoder,
    frame,
    split_frames,
)

ECHO = "/test.Echo/Echo"
HOLD = "/test.Echo/Hold"  # answers only when the client ends its messages


class Echo:
    """A test service: each message back as it comes (ECHO), or all of them at the end (HOLD)."""

    def __init__(self, stream: Stream, hold: bool, log: list[str]) -> None:
        self.stream, self.hold, self.log, self.kept = stream, hold, log, []

    def message(self, data: bytes) -> None:
        if self.hold:
            self.kept.append(data)
        else:
            self.stream.send(data)

    def end(self) -> None:
        for data in self.kept:
            self.stream.send(data)
        self.log.append("end")
        self.stream.finish()

    def cancel(self) -> None:
        self.log.append("cancel")


def grpc_message(data: bytes, compressed: bool = False) -> bytes:
    return bytes([compressed]) + struct.pack(">I", len(data)) + data


def request_headers(path: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "epp"),
            ("te", "trailers"), ("content-type", "application/grpc")]


class Client:
    """An HTTP/2 client connection to the server: send with `h2`, read events until a condition."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.h2.initiate_connection()
        self.data: dict[int, bytearray] = {}
        self.trailers: dict[int, dict[bytes, bytes]] = {}
        self.events: list[Any] = []
        self.auto_ack = True

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    async def until(self, done: Callable[[], bool], timeout: float = 5) -> None:
        async def read() -> None:
            while not done():
                chunk = await self.reader.read(65_536)
                if not chunk:
                    return
                for event in self.h2.receive_data(chunk):
                    self._event(event)
                await self.flush()
        await asyncio.wait_for(read(), timeout)

    def _event(self, event: Any) -> None:
        self.events.append(event)
        if isinstance(event, h2.events.DataReceived):
            self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
            if self.auto_ack:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.TrailersReceived):
            self.trailers[event.stream_id] = dict(event.headers)
        elif isinstance(event, h2.events.ResponseReceived) and any(k == b"grpc-status" for k, _ in event.headers):
            self.trailers[event.stream_id] = dict(event.headers)  # trailers only

    def status(self, sid: int) -> int:
        return int(self.trailers[sid][b"grpc-status"])


def serve(scenario: Callable[[Client, GrpcServer, list[str]], Awaitable[None]], window: int = 65_535,
          max_message: int = 1 << 20) -> list[str]:
    """Run `scenario` against a server of the test service on a free loopback port; what the calls logged."""
    log: list[str] = []

    async def main() -> None:
        server = GrpcServer({ECHO: lambda s: Echo(s, False, log), HOLD: lambda s: Echo(s, True, log)}, max_message)
        port = server.bind("127.0.0.1", 0)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = Client(reader, writer, window)
        await client.flush()
        try:
            await scenario(client, server, log)
        finally:
            writer.close()
            await server.stop(0.5)

    asyncio.run(main())
    return log


def test_flow_control_holds_both_ways_with_small_windows() -> None:
    """A 5 MB message in (past the server's 4 MiB stream window: the client waits for its updates) and
    back out through a 16 KB stream window that the client opens only as it reads."""
    big = bytes(range(256)) * 20_480

    async def scenario(c: Client, server: GrpcServer, log: list[str]) -> None:
        sid = c.h2.get_next_available_stream_id()
        c.h2.send_headers(sid, request_headers(HOLD))
        payload, waited = grpc_message(big), 0
        while payload:  # as far as the server's windows let us, then wait for its updates
            n = min(len(payload), c.h2.local_flow_control_window(sid), c.h2.max_outbound_frame_size)
            if n == 0:
                await c.until(lambda: c.h2.local_flow_control_window(sid) > 0)
                waited += 1
                continue
            c.h2.send_data(sid, payload[:n], end_stream=n == len(payload))
            payload = payload[n:]
            await c.flush()
        await c.until(lambda: sid in c.trailers)
        assert c.status(sid) == 0 and bytes(c.data[sid]) == grpc_message(big)
        assert waited > 0

    assert serve(scenario, window=16_384, max_message=8 << 20) == ["end"]


def test_a_message_split_and_padded_and_headers_in_continuation_frames() -> None:
    async def scenario(c: Client, server: GrpcServer, log: list[str]) -> None:
        sid = c.h2.get_next_available_stream_id()
        block = hpack.Encoder().encode(request_headers(ECHO))  # our own frames: h2 never splits so small a block
        c.writer.write(c.h2.data_to_send() + frame(HEADERS, 0, sid, block[:5]) +
                       frame(CONTINUATION, END_HEADERS, sid, block[5:]))
        c.h2 = _adopt(c.h2, sid)
        message = grpc_message(b"hello, world")
        c.h2.send_data(sid, message[:3], pad_length=7)
        c.h2.send_data(sid, message[3:], end_stream=True, pad_length=2)
        await c.flush()
        await c.until(lambda: sid in c.trailers)
        assert c.status(sid) == 0 and bytes(c.data[sid]) == message

    serve(scenario)


def _adopt(conn: Any, sid: int) -> Any:
    """Let h2 carry on a stream whose HEADERS we wrote ourselves (it did not see them go)."""
    conn.send_headers(sid, request_headers(ECHO))  # opens its state for the stream...
    conn.data_to_send()  # ...but these bytes are dropped: the server already has the headers
    return conn


def test_ping_an_unknown_method_and_messages_the_server_refuses() -> None:
    async def scenario(c: Client, server: GrpcServer, log: list[str]) -> None:
        c.h2.ping(b"12345678")
        unknown, compressed, oversized = (c.h2.get_next_available_stream_id() + 2 * i for i in range(3))
        c.h2.send_headers(unknown, request_headers("/no.Such/Method"), end_stream=True)
        c.h2.send_headers(compressed, request_headers(ECHO))
        c.h2.send_data(compressed, grpc_message(b"x", compressed=True), end_stream=True)
        c.h2.send_headers(oversized, request_headers(ECHO))
        c.h2.send_data(oversized, struct.pack(">BI", 0, 2_000))  # says 2,000 bytes: over the limit
        await c.flush()
        await c.until(lambda: len(c.trailers) == 3 and any(isinstance(e, h2.events.PingAckReceived)
                                                           for e in c.events))
        ack = next(e for e in c.events if isinstance(e, h2.events.PingAckReceived))
        assert ack.ping_data == b"12345678"
        assert c.status(unknown) == UNIMPLEMENTED and b"/no.Such/Method" in c.trailers[unknown][b"grpc-message"]
        assert c.status(compressed) == UNIMPLEMENTED
        assert c.status(oversized) == RESOURCE_EXHAUSTED
        # the server ended the oversized call first: it resets the stream the client still sends on
        await c.until(lambda: any(isinstance(e, h2.events.StreamReset) and e.stream_id == oversized
                                  for e in c.events))

    assert serve(scenario, max_message=1_000) == ["cancel", "cancel"]  # the unknown method never had a call


def test_a_reset_cancels_the_call_and_a_graceful_stop_lets_an_open_call_finish() -> None:
    """With grpc's own client (h2's refuses to send once it has a GOAWAY, as a strict reading allows)."""
    log: list[str] = []

    async def main() -> None:
        server = GrpcServer({HOLD: lambda s: Echo(s, True, log)}, 1 << 20)
        port = server.bind("127.0.0.1", 0)
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            hold = channel.stream_stream(HOLD)  # raw bytes: no serializers
            reset = hold()
            await reset.write(b"a")
            kept = hold()
            await kept.write(b"b")
            await asyncio.sleep(0.1)
            reset.cancel()
            await asyncio.sleep(0.1)
            assert log == ["cancel"]
            stopping = asyncio.get_running_loop().create_task(server.stop(5))
            await asyncio.sleep(0.2)
            assert not stopping.done()  # the call on `kept` is open: the server waits for it
            await kept.write(b"c")
            await kept.done_writing()
            assert [await kept.read(), await kept.read()] == [b"b", b"c"]
            assert await kept.code() == grpc.StatusCode.OK
            await asyncio.wait_for(stopping, 2)
            new = hold()
            with pytest.raises(grpc.aio.AioRpcError):  # stopped: nothing takes a call
                await new.write(b"d")
                await new.read()

    asyncio.run(main())
    assert log == ["cancel", "end"]


def test_a_stream_reset_after_its_pick_gives_the_worker_back() -> None:
    """The picked worker counts the request in flight until its stream ends, however it ends."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from gateway.config import GatewayConfig
    from gateway.epp.client import Stream as ExtProcStream
    from gateway.epp.client import request_bodies
    from gateway.epp.client import request_headers as ext_proc_headers
    from gateway.epp.server import EndpointPicker, Options

    async def main() -> None:
        epp = EndpointPicker(GatewayConfig(workers=["http://127.0.0.2:8999"]), Options(port=0, metrics_port=0))
        worker = epp.pool.workers[0]
        worker.healthy = True  # as a health poll would find it (none runs here)
        port = epp.bind()
        assert epp.server is not None
        await epp.server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            s = ExtProcStream(pb_grpc.ExternalProcessorStub(channel))
            await s.send(ext_proc_headers({}), *request_bodies(b'{"prompt": "hi", "max_tokens": 1}', 1))
            await s.wait(2)
            assert worker.in_flight == 1
            s.call.cancel()
            for _ in range(50):
                if worker.in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert worker.in_flight == 0
        await epp.stop(0.5)

    asyncio.run(main())


def test_a_client_that_does_not_speak_http2_is_told_and_closed() -> None:
    async def scenario(c: Client, server: GrpcServer, log: list[str]) -> None:
        reader, writer = await asyncio.open_connection(*c.writer.get_extra_info("peername"))
        writer.write(b"GET / HTTP/1.1\r\nHost: epp\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # to the end: the server closes
        kinds = [kind for kind, *_ in split_frames(answer)[0]]
        assert kinds[-1] == 7  # GOAWAY
        writer.close()

    serve(scenario)


def test_health_check_and_watch_with_grpc_s_own_client() -> None:
    async def main() -> None:
        health = Health()
        health.set("", SERVING)
        health.set("readiness", NOT_SERVING)
        server = GrpcServer(health.routes(), 1 << 20)
        port = server.bind("127.0.0.1", 0)
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Check(health_pb2.HealthCheckRequest(service="nothing"))
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            assert (await watch.read()).status == NOT_SERVING
            health.set("readiness", SERVING)
            assert (await watch.read()).status == SERVING
            health.enter_graceful_shutdown()
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
        await server.stop(1)
        assert "readiness" not in health.watchers  # the cancelled watch is gone

    asyncio.run(main())


def test_remembered_header_blocks_mean_what_a_fresh_decoder_says() -> None:
    """Index bytes repeat across streams; an entry added to the table shifts what they name."""
    encoder = hpack.Encoder()
    blocks = [encoder.encode([("x-a", "1")]), encoder.encode([("x-a", "1")]),  # added, then its index
              encoder.encode([("x-b", "2")]), encoder.encode([("x-a", "1")]), encoder.encode([("x-b", "2")])]
    assert blocks[1] != blocks[3]  # x-a moved down the table
    ours, reference = HeaderDecoder(65_536), hpack.Decoder()
    for block in [*blocks, blocks[1]]:  # blocks[1]'s bytes now name x-b: the memory must not answer x-a
        assert ours.decode(block) == dict(reference.decode(block, raw=True))
    assert blocks[1] == blocks[4]


class RawPeer:
    """A client of hand-written frames, for what no HTTP/2 library lets one send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.buf = reader, writer, b""
        self.encoder = hpack.Encoder()
        writer.write(PREFACE + frame(SETTINGS, 0, 0))

    def headers(self, sid: int, path: str, end: bool = False) -> bytes:
        return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, self.encoder.encode(request_headers(path)))

    async def frames_until(self, done: Callable[[list[tuple[int, int, int, bytes]]], bool],
                           timeout: float = 5) -> list[tuple[int, int, int, bytes]]:
        """(type, flags, stream, payload) of every frame read, until `done` says so or the server closes."""
        seen: list[tuple[int, int, int, bytes]] = []

        async def read() -> None:
            while not done(seen):
                frames, self.buf = split_frames(self.buf)
                seen.extend(frames)
                if done(seen):
                    return
                chunk = await self.reader.read(65_536)
                if not chunk:
                    return
                self.buf += chunk
        await asyncio.wait_for(read(), timeout)
        return seen


def raw(scenario: Callable[[RawPeer, GrpcServer], Awaitable[None]]) -> list[str]:
    log: list[str] = []

    async def main() -> None:
        server = GrpcServer({ECHO: lambda s: Echo(s, False, log), HOLD: lambda s: Echo(s, True, log)}, 1 << 20)
        port = server.bind("127.0.0.1", 0)
        await server.start()
        peer = RawPeer(*await asyncio.open_connection("127.0.0.1", port))
        try:
            await scenario(peer, server)
        finally:
            peer.writer.close()
            await server.stop(0.5)

    asyncio.run(main())
    return log


def _goaway(seen: list[tuple[int, int, int, bytes]]) -> bool:
    return any(f[0] == GOAWAY for f in seen)


@pytest.mark.parametrize(("bad", "why"), [
    (frame(SETTINGS, 0, 0, struct.pack(">HI", 5, 0)), "SETTINGS_MAX_FRAME_SIZE 0"),  # else empty DATA forever
    (frame(WINDOW_UPDATE, 0, 0, b"\x00\x01"), "WINDOW_UPDATE"),
    (frame(PING, 0, 0, b"short"), "PING"),
    (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF)), "past 2^31-1"),
    (frame(HEADERS, 0, 1, b"\x00" * 60_000) + frame(CONTINUATION, 0, 1, b"\x00" * 60_000), "header block"),
], ids=["max-frame-size-0", "window-update-2-bytes", "ping-5-bytes", "window-past-max", "endless-header-block"])
def test_a_malformed_frame_is_a_goaway_with_its_reason(bad: bytes, why: str) -> None:
    async def scenario(peer: RawPeer, server: GrpcServer) -> None:
        peer.writer.write(bad)
        seen = await peer.frames_until(_goaway)
        assert why.encode() in next(f[3] for f in seen if f[0] == GOAWAY)
        assert await peer.reader.read() == b""  # and the connection closes

    raw(scenario)


@pytest.mark.parametrize(("increment", "code"), [(0, 1), (0x7FFFFFFF, 3)], ids=["zero", "window-past-max"])
def test_a_bad_window_update_on_a_stream_resets_that_stream_alone(increment: int, code: int) -> None:
    """RFC 9113 6.9: an increment of 0 is a stream error PROTOCOL_ERROR (1); one that takes the stream's
    window past 2^31-1, FLOW_CONTROL_ERROR (3). The stream is reset; the connection goes on."""
    async def scenario(peer: RawPeer, server: GrpcServer) -> None:
        peer.writer.write(peer.headers(1, HOLD) + frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", increment)))
        seen = await peer.frames_until(lambda s: any(f[0] == RST_STREAM and f[2] == 1 for f in s))
        assert struct.unpack(">I", next(f for f in seen if f[0] == RST_STREAM)[3]) == (code,)
        peer.writer.write(frame(PING, 0, 0, b"8 bytes!"))
        seen = await peer.frames_until(lambda s: any(f[0] == PING and f[1] & ACK for f in s))
        assert not _goaway(seen)

    raw(scenario)


def test_an_initial_window_that_takes_an_open_stream_past_the_maximum_is_a_goaway() -> None:
    """RFC 9113 6.9.2: SETTINGS_INITIAL_WINDOW_SIZE moves every open stream's window; one past 2^31-1 is
    a connection error FLOW_CONTROL_ERROR."""
    async def scenario(peer: RawPeer, server: GrpcServer) -> None:
        peer.writer.write(peer.headers(1, HOLD) + frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 1))
                          + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 0x7FFFFFFF)))
        seen = await peer.frames_until(_goaway)
        assert b"past 2^31-1" in next(f[3] for f in seen if f[0] == GOAWAY)

    raw(scenario)


def test_a_graceful_stop_serves_a_stream_opened_before_its_last_goaway() -> None:
    """Two GOAWAYs: the first admits everything and carries a PING; the second, once the PING is
    back, names the last stream taken. A stream the client opened in between is served."""
    async def scenario(peer: RawPeer, server: GrpcServer) -> None:
        peer.writer.write(peer.headers(1, HOLD) + frame(DATA, 0, 1, grpc_message(b"kept")))
        await asyncio.sleep(0.05)
        stopping = asyncio.get_running_loop().create_task(server.stop(5))
        seen = await peer.frames_until(lambda s: any(f[0] == PING and not f[1] & ACK for f in s))
        first = next(f for f in seen if f[0] == GOAWAY)
        assert struct.unpack(">II", first[3]) == (0x7FFFFFFF, 0)
        ping = next(f for f in seen if f[0] == PING)
        peer.writer.write(peer.headers(3, ECHO) + frame(DATA, END_STREAM, 3, grpc_message(b"late")))
        seen = await peer.frames_until(lambda s: any(f[0] == HEADERS and f[2] == 3 and f[1] & END_STREAM for f in s))
        assert not any(f[0] == RST_STREAM for f in seen)  # served, not refused
        peer.writer.write(frame(PING, ACK, 0, ping[3]))
        seen = await peer.frames_until(_goaway)
        assert struct.unpack(">II", next(f for f in seen if f[0] == GOAWAY)[3]) == (3, 0)
        peer.writer.write(frame(HEADERS, END_HEADERS, 5, peer.encoder.encode(request_headers(ECHO))))
        seen = await peer.frames_until(lambda s: any(f[0] == RST_STREAM for f in s))
        assert struct.unpack(">I", next(f for f in seen if f[0] == RST_STREAM)[3]) == (7,)  # REFUSED_STREAM
        peer.writer.write(frame(DATA, END_STREAM, 1, b""))
        await asyncio.wait_for(stopping, 3)  # the held call ended: the stop is done

    assert raw(scenario) == ["end", "end"]
