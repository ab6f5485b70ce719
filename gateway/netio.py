"""An asyncio network backend for httpcore (the connection layer under httpx).

httpcore reaches asyncio through anyio, which wraps every socket read and write in a cancel scope and
answers "is this pooled connection still usable?" with a poll() system call per idle connection per
request. On the gateway's hot path that was a third of httpx's cost. This backend speaks to asyncio's
transports directly: data arrives in `data_received`, so whether an idle connection has been closed
or sent stray bytes is already known without a system call. HTTP itself stays with httpcore and h11.

Writes are corked until the response is read: httpcore writes a request's head and body separately,
and each write is a send() system call and a TCP segment the worker wakes up for. A request goes out
as one write when httpcore starts reading its response (or once 64 KiB are pending).

`UpstreamTransport.post`, the proxied request, goes further for plain-HTTP workers: gateway/http1.py's
pool, without httpcore and h11 at all (a third of the cost again). HTTPS stays on httpcore.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, NamedTuple

import httpcore
import httpx

from gateway.http1 import Http1Pool, Http1Response, WriteFlow, request_head

CORK_BYTES = 64 * 1024


class _Stream(WriteFlow, httpcore.AsyncNetworkStream):
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._pending: list[bytes] = []  # corked writes
        self._pending_size = 0

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self._eof, self._error = True, exc
        self._wake()
        self._release_writers()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- httpcore.AsyncNetworkStream -----------------------------------------------------------
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._pending:
            self._flush()
        if not self._buffer and not self._eof:
            self._waiter = waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout, _expire, waiter) if timeout is not None else None
            try:
                await waiter
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data for {timeout} s") from None
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        if not self._buffer and self._error is not None:
            raise httpcore.ReadError(str(self._error))
        data = bytes(self._buffer[:max_bytes])
        del self._buffer[:max_bytes]
        return data  # b"" at end of stream, as httpcore expects

    def _flush(self) -> None:
        if self._transport is None or self._transport.is_closing():
            self._pending.clear()
            raise httpcore.WriteError("connection closed")
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        self._pending_size = 0
        self._transport.write(data)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._transport is None or self._transport.is_closing():
            raise httpcore.WriteError("connection closed")
        if not buffer:
            return
        self._pending.append(buffer)
        self._pending_size += len(buffer)
        if self._pending_size < CORK_BYTES:
            return
        self._flush()
        if not await self._drained(timeout):  # the socket's send buffer stayed full
            raise httpcore.WriteTimeout(f"could not write for {timeout} s")

    async def aclose(self) -> None:
        if self._transport is not None:
            if self._pending and not self._transport.is_closing():
                self._flush()
            self._transport.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        assert self._transport is not None
        try:
            tls = await self._loop.start_tls(self._transport, self, ssl_context, server_hostname=server_hostname,
                                             ssl_handshake_timeout=timeout)
        except (OSError, ssl.SSLError) as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        if tls is None:
            raise httpcore.ConnectError("TLS handshake failed")
        self._transport = tls
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle pooled connection that got data or EOF is not reusable
            return bool(self._buffer) or self._eof
        if self._transport is None:
            return None
        key = {"ssl_object": "ssl_object", "client_addr": "sockname", "server_addr": "peername",
               "socket": "socket"}.get(info)
        return self._transport.get_extra_info(key) if key else None


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, stream = await loop.create_connection(
                    _Stream, host, port, local_addr=(local_address, 0) if local_address else None)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} took over {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = stream.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return stream

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, stream = await loop.create_unix_connection(_Stream, path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {path} took over {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return stream

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class UpstreamResponse:
    """A worker's response as the gateway's hot path uses it (status, headers, body or chunks)."""

    def __init__(self, response: httpcore.Response) -> None:
        self._response = response
        self.status_code = response.status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
        self.content = b""

    async def aread(self) -> bytes:
        with _httpx_errors():
            self.content = await self._response.aread()
        return self.content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for chunk in self._response.aiter_stream():
                yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


# httpcore's errors as httpx's (what callers catch), most specific first
_ERRORS: list[tuple[type[Exception], type[httpx.TransportError]]] = [
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError), (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError), (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.NetworkError, httpx.NetworkError), (httpcore.ProtocolError, httpx.ProtocolError),
]


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
        mapped = next(ours for theirs, ours in _ERRORS if isinstance(exc, theirs))
        raise mapped(str(exc)) from exc


class UpstreamTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (and its connection pool), on the asyncio backend above. `verify`: as
    httpx's; pass one SSLContext to many transports to load the CA bundle once.

    `post` is the gateway's hot path: straight to the httpcore pool under httpx, without building
    httpx's Request and Response objects (URL parsing, header normalisation, stream wrappers: a fifth
    of the upstream call's CPU, measured). Target URLs are parsed once per worker and path."""

    def __init__(self, limits: httpx.Limits, verify: ssl.SSLContext | bool = True) -> None:
        context = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
        super().__init__(limits=limits, verify=context)
        # httpx builds its httpcore pool without a way to pass a network backend: rebuild it with one.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            network_backend=AsyncioBackend(), socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self._targets: dict[str, _Target] = {}
        self._http1 = Http1Pool(limits.max_connections or 64)

    async def post(self, url: str, content: bytes, headers: dict[str, str],
                   timeout: dict[str, float | None]) -> UpstreamResponse | Http1Response:
        """POST `content`; raises httpx's transport errors. timeout: httpx.Timeout(...).as_dict().
        Plain-HTTP targets take the lean pool in gateway/http1.py, HTTPS ones httpcore's."""
        target = self._targets.get(url)
        if target is None:
            u = httpx.URL(url)
            port = u.port or (443 if u.scheme == "https" else 80)
            host = u.host if u.port is None else f"{u.host}:{u.port}"
            target = _Target(httpcore.URL(scheme=u.scheme.encode(), host=u.raw_host, port=port, target=u.raw_path),
                             (b"host", host.encode("ascii")), u.scheme == "http", u.host, port,
                             u.raw_path.decode("ascii"), host)
            if len(self._targets) < 1024:  # workers x paths: a handful
                self._targets[url] = target
        if target.plain:
            head = request_head("POST", target.path, target.host_header, headers, len(content))
            return await self._http1.post(target.host, target.port, head, content, timeout)
        fields = [target.host_field, (b"content-length", str(len(content)).encode())]
        fields += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        request = httpcore.Request(b"POST", target.url, headers=fields, content=content,
                                   extensions={"timeout": timeout})
        with _httpx_errors():
            return UpstreamResponse(await self._pool.handle_async_request(request))

    async def aclose(self) -> None:
        self._http1.close()
        await super().aclose()


class _Target(NamedTuple):
    url: httpcore.URL
    host_field: tuple[bytes, bytes]
    plain: bool  # http://: the lean pool
    host: str
    port: int
    path: str
    host_header: str
