"""The listening side of gateway/epp/h2.py: a port (plaintext, or TLS with ALPN h2), the connections
on it, a graceful stop; and the standard gRPC health service (grpc.health.v1: Check and Watch) that
Kubernetes probes and data planes ask."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from gateway.epp.h2 import Connection
from gateway.epp.h2call import Routes, Stream
from gateway.epp.h2wire import NOT_FOUND

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])  # gRPC clients refuse a TLS server that does not choose h2
    return context


class GrpcServer:
    """gRPC on one port: `bind` (synchronous, so a taken port is an error before anything starts),
    `start`, `stop` (GOAWAY to every connection, then `grace_s` for their open calls)."""

    def __init__(self, routes: Routes, max_message: int, tls: ssl.SSLContext | None = None) -> None:
        self.routes, self.max_message, self.tls = routes, max_message, tls
        self.connections: set[Connection] = set()
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._changed: asyncio.Event | None = None

    def bind(self, host: str, port: int) -> int:
        """Listen on host:port (OSError if it cannot); the port (its number, when 0 asked for any)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=1024)
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        assert self._sock is not None, "bind first"
        self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self.routes, self.max_message, self),
                                                sock=self._sock, ssl=self.tls)

    def wake(self) -> None:
        """A connection closed, or its last stream did (what `stop` waits for)."""
        if self._changed is not None:
            self._changed.set()

    async def stop(self, grace_s: float) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.go_away()
        deadline = time.monotonic() + grace_s
        while any(c.streams for c in self.connections) and (left := deadline - time.monotonic()) > 0:
            assert self._changed is not None
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                break
        for conn in list(self.connections):  # what is still open past the grace is cut off
            if conn.transport is not None:
                conn.transport.abort()  # close() would wait for a peer that no longer reads
        await self._server.wait_closed()


class Health:
    """grpc.health.v1.Health from a status per service name ("" is the server as a whole)."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.watchers: dict[str, set[Stream]] = {}
        self.stopping = False

    def set(self, service: str, status: int) -> None:
        if self.stopping:
            return
        self.status[service] = status
        answer = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        for stream in list(self.watchers.get(service, ())):
            stream.send(answer)

    def enter_graceful_shutdown(self) -> None:
        """Everything NOT_SERVING from now on, whatever is set later (as grpc's own servicer does)."""
        for service in self.status:
            self.set(service, NOT_SERVING)
        self.stopping = True

    def routes(self) -> Routes:
        return {"/grpc.health.v1.Health/Check": lambda stream: _Check(self, stream),
                "/grpc.health.v1.Health/Watch": lambda stream: _Watch(self, stream)}


class _Check:
    def __init__(self, health: Health, stream: Stream) -> None:
        self.health, self.stream, self.service = health, stream, ""

    def message(self, data: bytes) -> None:
        self.service = health_pb2.HealthCheckRequest.FromString(data).service

    def end(self) -> None:
        status = self.health.status.get(self.service)
        if status is None:
            self.stream.finish(NOT_FOUND, f"unknown service {self.service!r}")
            return
        self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.stream.finish()

    def cancel(self) -> None:
        pass


class _Watch:
    """The service's status now, then each change, until the client goes."""

    def __init__(self, health: Health, stream: Stream) -> None:
        self.health, self.stream, self.service = health, stream, None

    def message(self, data: bytes) -> None:
        if self.service is not None:
            return
        self.service = health_pb2.HealthCheckRequest.FromString(data).service
        status = self.health.status.get(self.service, SERVICE_UNKNOWN)
        self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.health.watchers.setdefault(self.service, set()).add(self.stream)

    def end(self) -> None:
        pass  # the client has said what to watch: the answers go on

    def cancel(self) -> None:
        watching = None if self.service is None else self.health.watchers.get(self.service)
        if watching is not None:
            watching.discard(self.stream)
            if not watching:
                del self.health.watchers[self.service]  # type: ignore[index]
