"""Workers found by DNS (`dns:NAME:PORT`, gateway/discovery.py): a real DNS server on 127.0.0.1
(dnslib) whose records change while the test runs, and real HTTP workers on 127.0.0.2, .3, .4 (one
port, as a headless Service's pods). A worker that appears takes traffic once its health check
passes; one that disappears finishes what it has and gets nothing new; a lookup that fails keeps
the members known; and through a real `flowprefill gateway` under load, no request is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from processes import free_port, stop, wait_healthy

from gateway.cli import main as cli_main
from gateway.config import Discovery
from gateway.discovery import DnsTarget, parse_target
from gateway.fleet import Worker, Zone, dns_server, serve_at
from gateway.routing import WorkerPool

NAME = "workers.flowprefill.test"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flowprefill.gateway"]


@contextmanager
def fleet(zone: Zone) -> Iterator[tuple[int, int, dict[str, Worker]]]:
    """The DNS server and a worker on each of HOSTS (all on one port): (DNS port, worker port, workers)."""
    port = free_port()
    workers = {h: Worker(h) for h in HOSTS}
    with ExitStack() as stack:
        dns_port = stack.enter_context(dns_server(zone))
        for host, w in workers.items():
            stack.enter_context(serve_at(w, host, port))
        yield dns_port, port, workers


def test_dns_sources_parse() -> None:
    assert parse_target("http://10.0.0.5:8001") is None
    assert parse_target("dns:flowprefill-worker.default.svc.cluster.local:8001") == DnsTarget(
        "flowprefill-worker.default.svc.cluster.local", 8001)
    assert DnsTarget("w", 8001).url("fd00::1") == "http://[fd00::1]:8001"
    for bad in ("dns:worker", "dns::8001", "dns:worker:http", "dns:worker:70000"):
        with pytest.raises(ValueError, match="dns:NAME:PORT"):
            parse_target(bad)


def test_the_pool_follows_the_records(caplog: pytest.LogCaptureFixture) -> None:
    zone = Zone({NAME: HOSTS[:2]})
    with fleet(zone) as (dns_port, port, _), caplog.at_level(logging.INFO, "flowprefill.gateway"):
        url = {h: f"http://{h}:{port}" for h in HOSTS}

        async def main() -> None:
            async with httpx.AsyncClient() as client:
                settings = Discovery(nameservers=["127.0.0.1"], port=dns_port, interval_s=0.2)
                pool = WorkerPool([f"dns:{NAME}:{port}"], client, discovery=settings)
                await pool.poll_once()  # the first lookup, then the health checks
                assert sorted(w.url for w in pool.workers if w.healthy) == [url[h] for h in HOSTS[:2]]
                caplog.clear()
                zone.set(NAME, HOSTS)  # scaled up
                await pool.discover()
                new = next(w for w in pool.workers if w.url == url[HOSTS[2]])
                assert new.healthy and new.backlog_by_class == {}  # checked on joining, not at the next poll
                assert messages(caplog) == [f"worker {url[HOSTS[2]]} joined the pool (dns:{NAME}:{port})",
                                            f"worker {url[HOSTS[2]]} healthy: in rotation"]
                caplog.clear()
                busy = await pool.acquire(0.0, exclude={url[HOSTS[1]], url[HOSTS[2]]})
                assert busy is not None and busy.url == url[HOSTS[0]]
                zone.set(NAME, HOSTS[1:])  # its pod went away, a request still in flight there
                await pool.discover()
                assert busy not in pool.workers and pool.draining == {busy.url: busy}
                assert {pool.pick().url for _ in range(20)} == {url[h] for h in HOSTS[1:]}  # nothing new for it
                pool.release(busy)
                assert pool.draining == {} and (pool.joined, pool.left) == (3, 1)
                assert messages(caplog) == [
                    f"worker {busy.url} left the pool: finishing its 1 request(s) in flight, no new ones",
                    f"worker {busy.url} drained: its last request in flight is done"]

        asyncio.run(main())


def test_a_failed_lookup_keeps_the_members_and_a_missing_name_empties_them(caplog: pytest.LogCaptureFixture) -> None:
    zone = Zone({NAME: HOSTS[:2]})
    with fleet(zone) as (dns_port, port, _), caplog.at_level(logging.INFO, "flowprefill.gateway"):

        async def main() -> None:
            async with httpx.AsyncClient() as client:
                settings = Discovery(nameservers=["127.0.0.1"], port=dns_port, timeout_s=0.5)
                static = f"http://127.0.0.1:{free_port()}"  # listed by hand beside the DNS source: always kept
                pool = WorkerPool([static, f"dns:{NAME}:{port}"], client, discovery=settings)
                await pool.poll_once()
                members = [w.url for w in pool.workers]
                assert len(members) == 3
                caplog.clear()
                zone.failing = True  # the DNS server answers SERVFAIL
                zone.delay_s = {"A": 0.1}  # AAAA fails first: the outage still reads (and is logged) as one
                for _ in range(2):
                    await pool.discover()
                    assert [w.url for w in pool.workers] == members
                (warning,) = messages(caplog)  # once, not at every lookup
                assert warning.startswith(f"dns:{NAME}:{port}: A lookup failed") and "keeping its 2" in warning
                zone.failing, zone.delay_s = False, {}
                zone.records.pop(NAME)  # the Service is gone: NXDOMAIN
                caplog.clear()
                await pool.discover()
                assert [w.url for w in pool.workers] == [static]
                assert messages(caplog)[0] == f"dns:{NAME}:{port}: no A or AAAA records (no worker there)"

        asyncio.run(main())


def test_aaaa_records_are_workers_too() -> None:
    zone = Zone({NAME: ["127.0.0.2", "fd00::7"]})
    with dns_server(zone) as dns_port:

        async def main() -> None:
            async with httpx.AsyncClient() as client:
                pool = WorkerPool([f"dns:{NAME}:8001"], client,
                                  discovery=Discovery(nameservers=["127.0.0.1"], port=dns_port))
                pool.set_members(await pool.discovery.members())
                assert sorted(w.url for w in pool.workers) == ["http://127.0.0.2:8001", "http://[fd00::7]:8001"]
                assert sorted(w.address for w in pool.workers) == ["127.0.0.2:8001", "[fd00::7]:8001"]

        asyncio.run(main())


def test_without_nameservers_the_system_resolver_reads_etc_hosts() -> None:
    """No `discovery.nameservers`: NAME resolves as every program's names do (getaddrinfo: /etc/hosts,
    resolv.conf's search domains), so `dns:localhost:PORT` finds a worker listening on 127.0.0.1
    (/etc/hosts maps localhost; a DNS server is never asked for it)."""
    port = free_port()
    with serve_at(Worker("local"), "127.0.0.1", port):

        async def main() -> None:
            async with httpx.AsyncClient() as client:
                pool = WorkerPool([f"dns:localhost:{port}"], client, discovery=Discovery())
                await pool.poll_once()
                healthy = [w.url for w in pool.workers if w.healthy]
                assert f"http://127.0.0.1:{port}" in healthy, [w.url for w in pool.workers]

        asyncio.run(main())


@pytest.mark.parametrize(("errno", "members"), [(socket.EAI_NONAME, 0), (socket.EAI_AGAIN, 1)])
def test_the_system_resolvers_answers(errno: int, members: int, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """getaddrinfo's "no such name" empties the source, as NXDOMAIN does; "no nameserver answered"
    (EAI_AGAIN) is a failed lookup: the members already known stay."""
    pool_sources = ["dns:workers.flowprefill.test:8001"]

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(pool_sources, client, discovery=Discovery())
            loop = asyncio.get_running_loop()

            async def found(*_: object, **__: object) -> list[tuple]:
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", 0))]

            async def failing(*_: object, **__: object) -> list[tuple]:
                raise socket.gaierror(errno, "refused by the test")

            monkeypatch.setattr(loop, "getaddrinfo", found)
            pool.set_members(await pool.discovery.members())
            assert [w.url for w in pool.workers] == ["http://127.0.0.2:8001"]
            monkeypatch.setattr(loop, "getaddrinfo", failing)
            caplog.clear()  # (the join above is logged where an earlier test left the level at INFO)
            with caplog.at_level(logging.INFO, "flowprefill.gateway"):
                pool.set_members(await pool.discovery.members())
            assert len(pool.workers) == members
            assert messages(caplog)[0] == (f"{pool_sources[0]}: lookup failed: refused by the test; keeping its 1 "
                                           "known worker(s)" if members else
                                           f"{pool_sources[0]}: no A or AAAA records (no worker there)")

    asyncio.run(main())


def test_a_malformed_dns_source_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["gateway", "--workers", "dns:flowprefill-worker"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dns:NAME:PORT" in err


class Load:
    """Clients sending completions through the gateway one after another until stopped; every answer
    kept (status and the worker that wrote it)."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.answers, self._stop = url, [], threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(f"{self.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                    self.answers.append((r.status_code, r.json()["choices"][0]["text"] if r.is_success else r.text))
                except httpx.HTTPError as exc:
                    self.answers.append((0, repr(exc)))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _until(what: str, ok: object, timeout: float = 20) -> float:
    """Wait until `ok()` is true; the seconds it took."""
    t0 = time.monotonic()
    while not ok():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, f"timed out waiting: {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_the_gateway_follows_the_records_under_load_and_loses_nothing(tmp_path: Path) -> None:
    zone = Zone({NAME: HOSTS[:2]})
    with fleet(zone) as (dns_port, port, workers):
        (tmp_path / "gw.toml").write_text(f'[discovery]\nnameservers = ["127.0.0.1"]\nport = {dns_port}\n'
                                          "interval_s = 0.5\n")
        gw_port = free_port()
        with (tmp_path / "gateway.log").open("w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--port", str(gw_port),
                                     "--config", str(tmp_path / "gw.toml"), "--workers", f"dns:{NAME}:{port}"],
                                    stdout=subprocess.DEVNULL, stderr=err)
        url = f"http://127.0.0.1:{gw_port}"
        try:
            wait_healthy(url, proc, timeout=60)
            with Load(url, clients=6) as load:
                _until("traffic on both workers", lambda: all(workers[h].hits["/v1/completions"] for h in HOSTS[:2]))
                assert workers[HOSTS[2]].hits["/v1/completions"] == 0
                zone.set(NAME, HOSTS)  # scaled up: in rotation within one lookup interval and one health check
                _until("the new worker takes traffic", lambda: workers[HOSTS[2]].hits["/v1/completions"], timeout=10)
                gone = workers[HOSTS[0]]
                _until("requests in flight on the worker about to go", lambda: gone.in_flight > 0)
                zone.set(NAME, HOSTS[1:])  # its pod is going away while it serves
                log = tmp_path / "gateway.log"
                left = f"http://{HOSTS[0]}:{port} left the pool"
                _until("it leaves", lambda: left in log.read_text(), timeout=10)
                # in flight when the lookup came (requests come and go: between the test's look and the
                # gateway's next lookup all of them may have ended: likely so in one CI run), it drains
                if "finishing its" in next(line for line in log.read_text().splitlines() if left in line):
                    _until("it drains", lambda: f"http://{HOSTS[0]}:{port} drained" in log.read_text(), timeout=10)
                last = gone.hits["/v1/completions"]
                before = len(load.answers)
                _until("more requests after it left", lambda: len(load.answers) > before + 60)
                assert gone.hits["/v1/completions"] == last, "a request was routed to a worker that had left"
            statuses = {status for status, _ in load.answers}
            assert statuses == {200}, [a for a in load.answers if a[0] != 200][:3]
            assert {text for _, text in load.answers} == set(HOSTS)
            metrics = httpx.get(f"{url}/metrics").text
            assert 'flowprefill_gateway_workers{pool="workers",state="healthy"} 2.0' in metrics, metrics[-900:]
            assert 'flowprefill_gateway_worker_changes_total{change="joined",pool="workers"} 3.0' in metrics
            assert 'flowprefill_gateway_worker_changes_total{change="left",pool="workers"} 1.0' in metrics
        finally:
            with contextlib.suppress(Exception):
                stop(proc)


@pytest.mark.slow
def test_a_real_worker_found_by_dns_serves_through_the_gateway(tmp_path: Path) -> None:
    """End to end: `flowprefill worker` on 127.0.0.2, found by its record, answers an OpenAI client."""
    import openai

    from gateway.processes import start

    zone = Zone({NAME: ["127.0.0.2"]})
    port, gw_port = free_port(), free_port()
    with dns_server(zone) as dns_port:
        worker = start("worker", "--model", "tiny", "--host", "127.0.0.2", "--port", str(port), "--threads", "1",
                       "--kv-capacity-tokens", "65536")
        try:
            wait_healthy(f"http://127.0.0.2:{port}", worker)
            (tmp_path / "gw.toml").write_text(f'[discovery]\nnameservers = ["127.0.0.1"]\nport = {dns_port}\n')
            gateway = start("gateway", "--port", str(gw_port), "--config", str(tmp_path / "gw.toml"),
                            "--workers", f"dns:{NAME}:{port}")
            try:
                wait_healthy(f"http://127.0.0.1:{gw_port}", gateway, timeout=60)
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="unused")
                out = client.completions.create(model="flowprefill-default", prompt="Hello", max_tokens=4,
                                                temperature=0, extra_body={"ignore_eos": True})
                assert out.usage.completion_tokens == 4
                assert httpx.get(f"http://127.0.0.1:{gw_port}/health").json()["workers"] == {
                    f"http://127.0.0.2:{port}": True}
            finally:
                stop(gateway)
        finally:
            stop(worker)


@pytest.mark.parametrize(("reports", "read"), [(True, True), (False, True), (True, False)])
def test_a_workers_load_report_ranks_it_until_the_next_poll(reports: bool, read: bool) -> None:
    """Two workers whose GET /load both say idle; one's answers report a 5 s backlog (ORCA's
    `endpoint-load-metrics`), the other's none. Sent one after another, the requests go to the other
    once an answer has reported it (polls between them may put the busy one back for a request or
    two); without reports, or with the gateway's `load_reports: false`, they alternate."""
    from litestar.testing import TestClient

    from gateway.app import create_gateway_app
    from gateway.config import GatewayConfig

    port = free_port()
    busy, idle = Worker("busy", delay_s=0.01, reports_s=5.0 if reports else None), Worker("idle", delay_s=0.01)
    with serve_at(busy, HOSTS[0], port), serve_at(idle, HOSTS[1], port):
        cfg = GatewayConfig(workers=[f"http://{HOSTS[0]}:{port}", f"http://{HOSTS[1]}:{port}"], load_reports=read)
        with TestClient(create_gateway_app(cfg)) as client:
            names = [client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["choices"][0]["text"]
                     for _ in range(12)]
    if reports and read:
        assert names.count("idle") >= 9, names
    else:
        assert names.count("idle") == 6, names
