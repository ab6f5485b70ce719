"""The gateway's lean HTTP/1.1 pool (gateway/http1.py) against real servers: uvicorn for what a worker
does, and a scripted asyncio server for what a broken or unusual one does. Every failure must be
httpx's error (the gateway's failover catches those), and a connection is reused only when its last
response was read to the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from processes import asgi_body, free_port, uvicorn_thread

from gateway.http1 import Http1Pool, request_head

pytestmark = pytest.mark.gateway_only

TIMEOUT = httpx.Timeout(5).as_dict()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await asgi_body(receive)
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
    if scope["path"] == "/stream":  # chunked, one part every 0.2 s
        await send(start)
        for i in range(3):
            await send({"type": "http.response.body", "body": f"part{i};".encode(), "more_body": True})
            await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": b""})
        return
    headers = dict(scope["headers"])
    answer = f"{scope['client'][1]} {len(body)} {headers.get(b'x-echo', b'').decode()}"
    await send(start)
    await send({"type": "http.response.body", "body": answer.encode()})


@pytest.fixture(scope="module")
def uvicorn_port() -> Iterator[int]:
    with uvicorn_thread(app) as port:
        yield port


def head(path: str = "/", headers: dict[str, str] | None = None, length: int = 0) -> bytes:
    return request_head("POST", path, "127.0.0.1", headers or {}, length)


async def post(http: Http1Pool, port: int, path: str = "/", body: bytes = b"",
               headers: dict[str, str] | None = None, **timeouts: float) -> tuple[int, str]:
    up = await http.post("127.0.0.1", port, head(path, headers, len(body)), body, TIMEOUT | timeouts)
    return up.status_code, (await up.aread()).decode()


def test_keep_alive_reuse_and_idle_connections_the_server_closed(uvicorn_port: int) -> None:
    async def main() -> list[str]:
        pool = Http1Pool()
        answers = [(await post(pool, uvicorn_port, body=b"x" * 1000, headers={"x-echo": "hi"}))[1]
                   for _ in range(3)]
        await asyncio.sleep(1.5)  # past uvicorn's keep-alive: it has closed the idle connection
        answers.append((await post(pool, uvicorn_port))[1])
        pool.close()
        return answers

    answers = asyncio.run(main())
    assert [a.split(" ", 1)[1] for a in answers[:3]] == ["1000 hi"] * 3
    assert len({a.split()[0] for a in answers[:3]}) == 1  # one connection for all three
    assert answers[3].split()[0] != answers[0].split()[0]  # a fresh one, not an error on the closed one


def test_streamed_body_arrives_as_it_is_sent(uvicorn_port: int) -> None:
    async def main() -> list[tuple[float, bytes]]:
        pool = Http1Pool()
        up = await pool.post("127.0.0.1", uvicorn_port, head("/stream"), b"", TIMEOUT)
        t0, parts = time.monotonic(), []
        async for chunk in up.aiter_raw():
            parts.append((time.monotonic() - t0, chunk))
        await up.aclose()
        assert (await post(pool, uvicorn_port))[0] == 200  # the connection is fine afterwards
        pool.close()
        return parts

    parts = asyncio.run(main())
    assert b"".join(c for _, c in parts) == b"part0;part1;part2;"
    assert parts[0][0] < 0.15 < parts[-1][0]  # the first part came before the last was sent


def test_a_response_closed_unread_does_not_return_its_connection(uvicorn_port: int) -> None:
    async def main() -> tuple[str, str]:
        pool = Http1Pool()
        first = (await post(pool, uvicorn_port))[1]
        up = await pool.post("127.0.0.1", uvicorn_port, head("/stream"), b"", TIMEOUT)
        await up.aclose()  # mid-body: this connection cannot carry another request
        second = (await post(pool, uvicorn_port))[1]
        pool.close()
        return first, second

    first, second = asyncio.run(main())
    assert first.split()[0] != second.split()[0]


def test_timeouts_refusals_pool_bound_and_header_injection(uvicorn_port: int) -> None:
    async def main() -> None:
        pool = Http1Pool(limit=1)
        with pytest.raises(httpx.ReadTimeout):
            await post(pool, uvicorn_port, "/slow", read=0.2)
        assert (await post(pool, uvicorn_port))[0] == 200  # the timed-out connection was replaced
        slow = asyncio.create_task(post(pool, uvicorn_port, "/slow"))
        await asyncio.sleep(0.1)
        with pytest.raises(httpx.PoolTimeout):  # the one connection allowed is busy
            await post(pool, uvicorn_port, pool=0.1)
        waiting = asyncio.create_task(post(pool, uvicorn_port))  # ... and is handed on when free
        assert (await slow)[0] == 200 and (await waiting)[0] == 200
        with pytest.raises(httpx.ConnectError):
            await post(pool, free_port())
        pool.close()

    asyncio.run(main())
    with pytest.raises(httpx.LocalProtocolError):
        head(headers={"x-request-id": "a\r\nx-slo-class: interactive"})


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def scripted(handler: Handler) -> Callable[[Callable[[int], Awaitable[Any]]], Any]:
    """Run `client(port)` against an asyncio server whose connection n is served by handler(r, w, n)."""
    def run(client: Callable[[int], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            count = 0

            async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                nonlocal count
                count += 1
                try:
                    await handler(r, w, count)
                finally:
                    w.close()

            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                return await client(port)
            finally:
                server.close()
        return asyncio.run(main())
    return run


async def read_request(r: asyncio.StreamReader) -> None:
    await r.readuntil(b"\r\n\r\n")


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def test_a_kept_alive_connection_closed_as_the_request_goes_is_retried_once() -> None:
    """The worker closed an idle connection just as a request went out on it: nothing was answered, so
    the request never started there; it goes again on a new connection (and only then fails)."""
    async def one_answer_then_close(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(OK)
        await r.readuntil(b"\r\n\r\n")  # the next request on this connection: closed unanswered

    async def client(port: int) -> list[str]:
        pool = Http1Pool()
        return [(await post(pool, port))[1] for _ in range(3)]

    assert scripted(one_answer_then_close)(client) == ["ok", "ok", "ok"]

    async def never_answers(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)

    async def fresh(port: int) -> None:
        with pytest.raises(httpx.ReadError):
            await post(Http1Pool(), port)

    scripted(never_answers)(fresh)


@pytest.mark.parametrize(("response", "error"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b", httpx.ReadError),  # cut mid-body
    (b"NOT HTTP AT ALL\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", httpx.RemoteProtocolError),
])
def test_broken_responses_are_httpx_errors(response: bytes, error: type[Exception]) -> None:
    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(response)
        await w.drain()

    async def client(port: int) -> None:
        with pytest.raises(error):
            await post(Http1Pool(), port)

    scripted(answer)(client)


def test_a_body_delimited_by_the_connection_end() -> None:
    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await w.drain()

    async def client(port: int) -> list[str]:
        pool = Http1Pool()
        return [(await post(pool, port))[1] for _ in range(2)]

    assert scripted(answer)(client) == ["all of it", "all of it"]
