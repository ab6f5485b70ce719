"""The data plane's side of the endpoint picker protocol, for the tests and `flowprefill bench epp`:
the ext_proc messages Envoy sends in FULL_DUPLEX_STREAMED mode (built from the same protos,
xds-protos), and a `flowprefill epp` process to send them to."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.processes import free_port, stop

Mode = processing_mode_pb2.ProcessingMode


def _metadata(namespaces: dict[str, dict[str, object]]) -> base_pb2.Metadata:
    metadata = base_pb2.Metadata()
    for name, fields in namespaces.items():
        struct = struct_pb2.Struct()
        struct.update(fields)
        metadata.filter_metadata[name].CopyFrom(struct)
    return metadata


def request_headers(headers: dict[str, str], end_of_stream: bool = False, path: str = "/v1/completions",
                    method: str = "POST", subset: list[str] | None = None,
                    protocol: tuple[int, int] | None = None) -> pb.ProcessingRequest:
    """The request's headers as Envoy sends them (pseudo-headers first, values as raw bytes);
    `subset`: an `envoy.lb.subset_hint`; `protocol`: the (request, response) body modes Envoy
    announces in `protocol_config`."""
    everything = {":method": method, ":path": path, ":authority": "llm.example", ":scheme": "http",
                  "content-type": "application/json"} | headers
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=end_of_stream, headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in everything.items()])))
    if subset is not None:
        msg.metadata_context.CopyFrom(_metadata({"envoy.lb.subset_hint": {
            "x-gateway-destination-endpoint-subset": subset}}))
    if protocol is not None:
        msg.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=protocol[0],
                                                              response_body_mode=protocol[1]))
    return msg


def request_body(body: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def request_bodies(body: bytes, pieces: int) -> list[pb.ProcessingRequest]:
    """`body` in `pieces` chunks, as Envoy streams it (the last with end_of_stream)."""
    size = -(-len(body) // pieces)
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return [request_body(p, i == len(parts) - 1) for i, p in enumerate(parts)]


def response_headers(status: int = 200, served: str | None = None, end_of_stream: bool = False
                     ) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=end_of_stream, headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
                 {":status": str(status), "content-type": "application/json"}.items()])))
    if served is not None:
        msg.metadata_context.CopyFrom(_metadata({"envoy.lb": {"x-gateway-destination-endpoint-served": served}}))
    return msg


def response_body(body: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


class Stream:
    """One `Process` stream (one HTTP request): write messages, read the answers as they come."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()
        self.answers: list[pb.ProcessingResponse] = []
        self.ended = asyncio.Event()
        self._grew = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                self.answers.append(msg)
                self._grew.set()
        finally:
            self.ended.set()
            self._grew.set()

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for m in messages:
            await self.call.write(m)

    async def wait(self, n: int, timeout: float = 10) -> list[pb.ProcessingResponse]:
        """Until `n` answers have come in all (or the stream ended): the answers so far."""
        async def enough() -> None:
            while len(self.answers) < n and not self.ended.is_set():
                self._grew.clear()
                await self._grew.wait()
        try:
            await asyncio.wait_for(enough(), timeout)
        except TimeoutError:
            raise AssertionError(f"{len(self.answers)} answers of {n} after {timeout} s") from None
        return self.answers

    async def close(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 10)


def check_health(address: str, service: str, credentials: grpc.ChannelCredentials | None = None) -> int:
    """The picker's gRPC health status for `service` (health_pb2.HealthCheckResponse.ServingStatus)."""
    with (grpc.insecure_channel(address) if credentials is None
          else grpc.secure_channel(address, credentials)) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


@contextmanager
def epp_process(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                credentials: grpc.ChannelCredentials | None = None, core: int | None = None,
                pids: list[int] | None = None) -> Iterator[tuple[str, int]]:
    """`flowprefill epp ARGS` on free ports (pinned to `core`, if given; its pid appended to `pids`),
    until ready: (its gRPC address, its metrics port)."""
    import os

    port, metrics = free_port(), free_port()
    log = tmp_path / f"epp-{port}.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "epp", "--port", str(port), "--metrics-port",
                                 str(metrics), *args], stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **(env or {})},
                                preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}))
    if pids is not None:
        pids.append(proc.pid)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"flowprefill epp exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"flowprefill epp not ready: {log.read_text()}"
            try:
                if check_health(address, "readiness", credentials) == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        yield address, metrics
    finally:
        stop(proc)
