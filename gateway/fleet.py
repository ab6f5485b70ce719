"""A small fleet on this machine for the discovery and endpoint-picker tests and benchmarks
(`flowprefill bench epp`): a real DNS server (dnslib, a dev dependency) on 127.0.0.1 whose records
change as they run, and small real HTTP workers (/health, /load, /v1/completions) on other loopback
addresses (127.0.0.2, 127.0.0.3, …: Linux routes all of 127.0.0.0/8 to lo), all on one port, as a
headless Service's pods are."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from engine.protocol.worker import LOAD_REPORT_HEADER, WorkerLoad, load_report


class Zone(BaseResolver):
    """Records served by a dnslib server: {name: [addresses]}; a name not there is NXDOMAIN.
    `failing`: answer SERVFAIL to everything (a DNS outage); `delay_s`: seconds to wait before
    answering a query of a type ({"A": 0.1}: its AAAA answer comes first)."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = {self._key(k): list(v) for k, v in records.items()}
        self.failing = False
        self.delay_s: dict[str, float] = {}
        self.queries = 0
        self._lock = threading.Lock()

    @staticmethod
    def _key(name: str) -> str:
        return name.rstrip(".").lower()

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self.records[self._key(name)] = list(addresses)

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        self.queries += 1
        time.sleep(self.delay_s.get(QTYPE[request.q.qtype], 0.0))  # the server answers each query on a thread
        if self.failing:
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        qname, qtype = request.q.qname, QTYPE[request.q.qtype]
        with self._lock:
            addresses = self.records.get(self._key(str(qname)))
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for address in addresses:
            if qtype == "A" and ":" not in address:
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(address), ttl=0))
            elif qtype == "AAAA" and ":" in address:
                reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(address), ttl=0))
        return reply


@contextmanager
def dns_server(zone: Zone) -> Iterator[int]:
    """`zone` served over UDP on 127.0.0.1: its port."""
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=DNSLogger("-recv,-send,-request,-reply,-truncated,"
                                                                            "-error,-data", prefix=False))
    server.start_thread()
    try:
        yield server.server.server_address[1]
    finally:
        server.stop()
        server.server.server_close()


class Worker:
    """A worker's answers: /health, /load (its `backlog_s`), and completions that take `delay_s`
    and name the worker, each with an ORCA load report of `reports_s` as its backlog if given. Counts
    requests, keeps their arrival times and what is in flight."""

    def __init__(self, name: str, delay_s: float = 0.05, backlog_s: float = 0.0,
                 reports_s: float | None = None) -> None:
        self.name, self.delay_s, self.backlog_s, self.reports_s = name, delay_s, backlog_s, reports_s
        self.hits = Counter[str]()
        self.arrivals: list[float] = []
        self.in_flight = 0
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        self.hits[path] += 1
        status, body = 404, {"detail": "Not Found"}
        if path == "/health":
            status, body = 200, {"status": "ok", "role": "colocated"}
        elif path == "/load":
            status, body = 200, {"role": "colocated", "predicted_backlog_s": self.backlog_s,
                                 "predicted_backlog_by_class_s": {}}
        elif path == "/v1/completions":
            self.arrivals.append(time.monotonic())
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            self.in_flight += 1
            try:
                while (await receive()).get("more_body"):  # the whole request body
                    pass
                await asyncio.sleep(self.delay_s)
            finally:
                self.in_flight -= 1
            status, body = 200, {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
                {"index": 0, "text": self.name, "finish_reason": "length", "logprobs": None}]}
        headers = [(b"content-type", b"application/json")]
        if path == "/v1/completions" and self.reports_s is not None:
            report = load_report(WorkerLoad(predicted_backlog_s=self.reports_s))
            headers.append((LOAD_REPORT_HEADER.encode(), report.encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@contextmanager
def serve_at(app: Any, host: str, port: int) -> Iterator[None]:
    """An ASGI app served by uvicorn in a thread of this process on host:port (idle connections kept
    30 s: a keep-alive closed under the gateway as it sends would take the worker out for a moment)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"uvicorn did not start on {host}:{port}"
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)
