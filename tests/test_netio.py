"""The gateway's upstream transport against a real uvicorn server: httpx on the asyncio network backend
(connection reuse, idle connections the server closed, timeouts, refused connections, large bodies,
TLS) and the hot path `post` (plain HTTP: gateway/http1.py, tested in detail in test_http1.py)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import free_port, uvicorn_thread

from gateway.netio import UpstreamTransport

pytestmark = pytest.mark.gateway_only

LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    size = 0
    while True:
        msg = await receive()
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    body = f"{scope['client'][1]} {size}".encode()  # the client's port: which connection served it
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


def _serve(**kw: Any) -> Iterator[str]:
    with uvicorn_thread(app, **kw) as port:
        yield f"{'https' if kw else 'http'}://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from _serve()


def _client(**kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=UpstreamTransport(LIMITS, **kw), timeout=5)


def test_requests_reuse_one_connection_and_survive_the_server_closing_it(server: str) -> None:
    async def main() -> list[str]:
        async with _client() as c:
            ports = [(await c.get(server)).text.split()[0] for _ in range(3)]
            await asyncio.sleep(1.5)  # past the server's keep-alive: it closes the idle connection
            ports.append((await c.get(server)).text.split()[0])
            return ports

    ports = asyncio.run(main())
    assert ports[0] == ports[1] == ports[2]
    assert ports[3] != ports[0]  # a fresh connection, not an error on the closed one


def test_concurrent_requests_and_large_bodies(server: str) -> None:
    async def main() -> list[str]:
        async with _client() as c:
            big = b"x" * (8 << 20)  # larger than the socket buffers: writes must wait for the reader
            rs = await asyncio.gather(*(c.post(server, content=big) for _ in range(4)),
                                      *(c.get(server) for _ in range(20)))
            return [r.text.split()[1] for r in rs]

    sizes = asyncio.run(main())
    assert sizes[:4] == [str(8 << 20)] * 4 and sizes[4:] == ["0"] * 20


def test_a_request_goes_out_in_one_write(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """httpcore writes a request's head and body separately; each would be a send() and a segment the
    worker wakes up for. Corked, a small request is one transport write."""
    from gateway import netio

    writes: list[int] = []
    made = netio._Stream.connection_made

    def counting(self: Any, transport: Any) -> None:
        write = transport.write
        transport_proxy = type("CountingTransport", (), {
            "write": lambda _, data: (writes.append(len(data)), write(data))[1],
            "__getattr__": lambda _, name: getattr(transport, name)})()
        made(self, transport_proxy)

    monkeypatch.setattr(netio._Stream, "connection_made", counting)

    body = b'{"prompt": "hi", "max_tokens": 1}'

    async def main() -> list[str]:
        async with _client() as c:
            return [(await c.post(server, content=body)).text for _ in range(3)]

    assert [r.split()[1] for r in asyncio.run(main())] == [str(len(body))] * 3
    assert len(writes) == 3  # one per request: head and body together


def test_timeouts_and_refused_connections_are_httpx_errors(server: str) -> None:
    async def main() -> None:
        async with _client() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.get(f"{server}/slow", timeout=0.2)
            assert (await c.get(server)).status_code == 200  # the pool is still usable
            with pytest.raises(httpx.ConnectError):
                await c.get(f"http://127.0.0.1:{free_port()}")

    asyncio.run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    for url in _serve(ssl_keyfile=str(key), ssl_certfile=str(cert)):
        async def main(url: str = url) -> list[str]:
            context = ssl.create_default_context(cafile=str(cert))
            async with _client(verify=context) as c:
                answers = [(await c.get(url)).text]
            t = UpstreamTransport(LIMITS, context)  # the gateway's post: HTTPS goes through httpcore
            up = await t.post(f"{url}/v1/completions", b"{}", {"x-slo-class": "batch"}, httpx.Timeout(5).as_dict())
            answers.append((await up.aread()).decode())
            await up.aclose()
            await t.aclose()
            return answers

        assert [a.split()[1] for a in asyncio.run(main())] == ["0", "2"]


def test_post_fast_path_is_http_correct_and_raises_httpx_errors(server: str) -> None:
    """The gateway's hot path (`UpstreamTransport.post`; plain HTTP goes to gateway/http1.py's pool):
    the body arrives whole, the connection is reused, errors are httpx's, as the gateway catches them."""
    timeout = httpx.Timeout(5).as_dict()

    async def main() -> None:
        t = UpstreamTransport(LIMITS)
        try:
            answers = []
            for _ in range(3):
                up = await t.post(f"{server}/v1/completions", b"x" * 1000, {"x-slo-class": "batch"}, timeout)
                assert up.status_code == 200 and up.headers["content-type"] == "text/plain"
                answers.append((await up.aread()).decode())
                await up.aclose()
            assert {a.split()[1] for a in answers} == {"1000"} and len({a.split()[0] for a in answers}) == 1
            up = await t.post(f"{server}/stream", b"", {}, timeout)
            assert b"".join([c async for c in up.aiter_raw()]).endswith(b" 0")
            await up.aclose()
            with pytest.raises(httpx.ReadTimeout):
                await t.post(f"{server}/slow", b"", {}, httpx.Timeout(0.2).as_dict())
            with pytest.raises(httpx.ConnectError):
                await t.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", {}, timeout)
        finally:
            await t.aclose()

    asyncio.run(main())
