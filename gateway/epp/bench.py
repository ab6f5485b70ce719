"""`flowprefill bench epp`: what the endpoint picker adds to a request, how many picks one core
makes, and how fast a pool follows its DNS records.

A real `flowprefill epp`, pinned to one core, in front of small workers on 127.0.0.2-4 (this
process, gateway/fleet.py) found through a real DNS server (dnslib, a dev dependency), spoken to as
Envoy speaks in FULL_DUPLEX_STREAMED mode (gateway/epp/client.py):

- latency: one request at a time, a completion whose prompt is 2K tokens (8,192 characters): its
  request phase (headers and body in, the routed headers and the echoed body out: what the picker
  adds before the request can leave for a worker) and the whole stream (the response's headers and
  body passed through too); p50 and p99, client included: with a client of hand-written frames
  (gateway/epp/bench_client.py, whose own cost is small, as Envoy's C++ client's would be), and with
  grpc's Python client (which costs more than the picker: an upper bound);
- picks per second on one core: concurrent streams for a while; the picker's CPU seconds per pick
  (from /proc), inverted: what one core of picker can decide, whatever the client manages;
- discovery: a `flowprefill gateway` under load and the picker on the same DNS name; a worker's
  record is added, then removed, each round: the time to its first proxied request and to its first
  listing by the picker; the time it still got new requests after its record went, and the failed
  requests (there should be none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.common import Parser

NAME = "bench.flowprefill.test"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
PROMPT_CHARS = 8192  # 2K tokens at 4 characters a token


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench epp", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--requests", type=int, default=2000, help="latency samples")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streams for the throughput run")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the throughput run")
    p.add_argument("--rounds", type=int, default=5, help="discovery rounds (a worker added, then removed)")
    p.add_argument("--interval", type=float, default=1.0, help="discovery.interval_s of the gateway and picker")
    p.add_argument("--out", default="bench-results")
    return p


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    from gateway.epp import missing_extra

    args = build_parser().parse_args(argv)
    absent = [m for m in ("dnslib", "numpy") if not _has(m)]  # not the epp extra's: its DNS server, its summary
    problem = missing_extra() or (f"the benchmark needs {' and '.join(absent)}: pip install 'flowprefill[dev]'"
                                  if absent else None)
    if problem:
        print(f"flowprefill bench epp: error: {problem}", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console()
    cores = sorted(os.sched_getaffinity(0))
    results: dict[str, Any] = {"command": "flowprefill bench epp " + " ".join(argv if argv is not None else
                                                                              sys.argv[3:]),
                               "cores": len(cores), "epp_core": cores[0], "load_before": os.getloadavg()}
    os.sched_setaffinity(0, {cores[-1]})  # the client and the workers off the picker's core
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        fleet = _Fleet(stack, Path(tmp), args.interval, cores[0])
        with console.status("latency: one request at a time, a client of hand-written frames…"):
            results["latency"] = asyncio.run(_latency_raw(fleet.address, args.requests))
        with console.status("latency: one request at a time, grpc's Python client…"):
            results["latency_grpc_client"] = asyncio.run(_latency(fleet.address, args.requests))
        with console.status(f"throughput: {args.concurrency} streams for {args.seconds:g} s, three times…"):
            results["throughput"] = asyncio.run(_throughput(fleet, args.concurrency, args.seconds, True))
            results["throughput_request_phase"] = asyncio.run(_throughput(fleet, args.concurrency, args.seconds,
                                                                          False))
            results["throughput_request_phase_grpc_client"] = asyncio.run(_throughput(
                fleet, args.concurrency, args.seconds, False, client="grpc"))
        with console.status(f"discovery: {args.rounds} rounds of a worker added and removed under load…"):
            results["discovery"] = _discovery(fleet, args.rounds, args.interval)
    results["load_after"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "epp.json").write_text(json.dumps(results, indent=1))
    from gateway.epp.bench_report import plot, table

    console.print(table(results))
    plot(results, out / "epp.png")
    console.print(f"wrote {out / 'epp.json'} and {out / 'epp.png'}")
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class _Fleet:
    """The DNS server, the workers (the fourth one's record added and removed by the discovery
    rounds), the picker pinned to `core`, and a gateway on the same name."""

    def __init__(self, stack: ExitStack, tmp: Path, interval_s: float, core: int) -> None:
        from gateway.epp.client import epp_process
        from gateway.fleet import Worker, Zone, dns_server, serve_at
        from gateway.processes import free_port, start, stop, wait_healthy

        self.zone = Zone({NAME: HOSTS[:3]})
        dns_port = stack.enter_context(dns_server(self.zone))
        self.port = free_port()
        self.workers = {h: Worker(h, delay_s=0.05) for h in HOSTS}
        for host, w in self.workers.items():
            stack.enter_context(serve_at(w, host, self.port))
        config = tmp / "gateway.toml"
        config.write_text(f'[discovery]\nnameservers = ["127.0.0.1"]\nport = {dns_port}\ninterval_s = {interval_s}\n')
        source = f"dns:{NAME}:{self.port}"
        pids: list[int] = []
        self.address, _ = stack.enter_context(epp_process(tmp, "--workers", source, "--config", str(config),
                                                          "--endpoints", str(len(HOSTS)),
                                                          core=core, pids=pids))
        self.epp_pid = pids[0]
        g_port = free_port()
        gateway = start("gateway", "--workers", source, "--config", str(config), "--port", str(g_port))
        stack.callback(stop, gateway)
        self.gateway = f"http://127.0.0.1:{g_port}"
        wait_healthy(self.gateway, gateway, timeout=60)


def _messages() -> tuple[list[Any], list[Any]]:
    """The request phase's messages (headers, a 2K-token completion in one chunk) and the response's."""
    from gateway.epp.client import request_bodies, request_headers, response_body, response_headers

    body = json.dumps({"model": "m", "prompt": ("Tell me more about it. " * 400)[:PROMPT_CHARS],
                       "max_tokens": 64, "stream": True}).encode()
    answer = b'data: {"id": "cmpl-1", "choices": [{"text": "ok", "index": 0}]}\n\ndata: [DONE]\n\n'
    return ([request_headers({"x-slo-class": "interactive"}), *request_bodies(body, 1)],
            [response_headers(200), response_body(answer, True)])


async def _one(stub: Any, request: list[Any], response: list[Any]) -> tuple[float, float]:
    """(request phase, whole stream) in seconds."""
    from gateway.epp.client import Stream

    t0 = time.perf_counter()
    s = Stream(stub)
    await s.send(*request)
    await s.wait(2)
    routed = time.perf_counter() - t0
    if response:
        await s.send(*response)
        await s.wait(4)
    await s.close()
    return routed, time.perf_counter() - t0


def _summary(samples: list[tuple[float, float]], request_bytes: int, client: str) -> dict[str, Any]:
    import numpy as np  # here, not above: `--help` is read where only the gateway is installed

    routed = np.array([a for a, _ in samples]) * 1000
    whole = np.array([b for _, b in samples]) * 1000
    return {"client": client, "request_bytes": request_bytes, "samples": len(samples),
            "request_phase_p50_ms": float(np.median(routed)), "request_phase_p99_ms": float(np.percentile(routed, 99)),
            "stream_p50_ms": float(np.median(whole)), "stream_p99_ms": float(np.percentile(whole, 99)),
            "raw_ms": [[round(a, 4), round(b, 4)] for a, b in zip(routed.tolist(), whole.tolist(), strict=True)]}


async def _latency_raw(address: str, n: int) -> dict[str, Any]:
    """One request at a time through gateway/epp/bench_client.py (hand-written frames: its own cost
    is small next to the picker's)."""
    from gateway.epp.bench_client import RawClient

    messages = _messages()
    request, response = ([m.SerializeToString() for m in phase] for phase in messages)
    client = await RawClient.connect(address)
    samples = []
    try:
        for i in range(100 + n):  # the first 100: warm-up
            t0 = time.perf_counter()
            sid = client.open([])
            await client.phase(sid, request, 2)
            routed = time.perf_counter() - t0
            await client.phase(sid, response, 4, end=True)
            if i >= 100:
                samples.append((routed, time.perf_counter() - t0))
    finally:
        await client.close()
    return _summary(samples, len(messages[0][1].request_body.body),
                    "hand-written HTTP/2 frames (gateway/epp/bench_client.py)")


async def _latency(address: str, n: int) -> dict[str, Any]:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    request, response = _messages()
    samples = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for _ in range(100):  # warm-up: the channel, the picker's first requests
            await _one(stub, request, response)
        for _ in range(n):
            samples.append(await _one(stub, request, response))
    return _summary(samples, len(request[1].request_body.body), "grpc's Python client (grpc.aio)")


async def _throughput(fleet: _Fleet, concurrency: int, seconds: float, with_response: bool,
                      client: str = "raw") -> dict[str, Any]:
    """`concurrency` streams at a time through the picker for `seconds`, on one connection (as a data
    plane's worker thread has one), by `client` ("raw": gateway/epp/bench_client.py, fast enough to
    keep the picker's core busy; "grpc": grpc's Python client); `with_response`: each with its
    response passed through (else the stream ends after the request phase, as a data plane that
    skips response processing does)."""
    request, response = _messages()
    response = response if with_response else []
    one, close = await (_raw_streams if client == "raw" else _grpc_streams)(fleet.address, request, response)
    done = 0
    stop_at = time.monotonic() + seconds

    async def user() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await one()
            done += 1

    try:
        cpu0, t0 = _cpu_s(fleet.epp_pid), time.monotonic()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        cpu, wall = _cpu_s(fleet.epp_pid) - cpu0, time.monotonic() - t0
    finally:
        await close()
    return {"client": client, "picks": done, "seconds": wall, "achieved_picks_per_s": done / wall, "epp_cpu_s": cpu,
            "epp_cpu_ms_per_pick": 1000 * cpu / done, "one_core_picks_per_s": done / cpu if cpu else float("inf")}


async def _raw_streams(address: str, request: list[Any], response: list[Any]) -> tuple[Any, Any]:
    """(one stream, close) with gateway/epp/bench_client.py."""
    from gateway.epp.bench_client import RawClient

    client = await RawClient.connect(address)
    asked, answered = [m.SerializeToString() for m in request], [m.SerializeToString() for m in response]

    async def one() -> None:
        sid = client.open([])
        await client.phase(sid, asked, 2)
        await client.phase(sid, answered, 2 + 2 * bool(answered), end=True)

    return one, client.close


async def _grpc_streams(address: str, request: list[Any], response: list[Any]) -> tuple[Any, Any]:
    """(one stream, close) with grpc's Python client."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.ExternalProcessorStub(channel)

    async def one() -> None:
        await _one(stub, request, response)

    return one, channel.close


class _Load:
    """Clients sending completions through the gateway until stopped; (time, status) of each answer."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.url, self.answers = url, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    status = c.post(f"{self.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code
                except httpx.HTTPError:
                    status = 0
                self.answers.append((time.monotonic(), status))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _discovery(fleet: _Fleet, rounds: int, interval_s: float) -> dict[str, Any]:
    new, endpoint = fleet.workers[HOSTS[3]], f"{HOSTS[3]}:{fleet.port}"
    load = _Load(fleet.gateway)
    rows = []
    try:
        for _ in range(rounds):
            time.sleep(interval_s * 1.5)
            rows.append(_round(fleet, load, new, endpoint, interval_s))
    finally:
        load.stop()
    return {"interval_s": interval_s, "health_poll_s": 1.0, "rounds": rows,
            "requests": len(load.answers), "failed_requests": sum(s != 200 for _, s in load.answers)}


def _round(fleet: _Fleet, load: _Load, new: Any, endpoint: str, interval_s: float) -> dict[str, Any]:
    """A worker's record added, then removed: when it took requests and was listed, and what failed."""
    t0 = time.monotonic()
    fleet.zone.set(NAME, HOSTS)
    listed = _until(lambda: endpoint in _picked(fleet.address), t0)
    _until(lambda: any(t > t0 for t in new.arrivals), t0)
    served = min(t for t in new.arrivals if t > t0) - t0
    time.sleep(interval_s)
    failed_before = sum(s != 200 for _, s in load.answers)
    t1 = time.monotonic()
    fleet.zone.set(NAME, HOSTS[:3])
    unlisted = _until(lambda: endpoint not in _picked(fleet.address), t1)
    _until(lambda: new.in_flight == 0 and time.monotonic() - t1 > 3 * interval_s, t1)
    last = max((t for t in new.arrivals if t > t1), default=t1)
    return {"join_first_request_s": served, "join_listed_by_epp_s": listed, "leave_last_new_request_s": last - t1,
            "leave_unlisted_by_epp_s": unlisted,
            "failed_requests": sum(s != 200 for _, s in load.answers) - failed_before}


def _until(ok: Any, since: float, timeout: float = 30) -> float:
    while not ok():
        if time.monotonic() - since > timeout:
            raise TimeoutError("the pool did not follow its DNS records")
        time.sleep(0.01)
    return time.monotonic() - since


def _picked(address: str) -> str:
    """The endpoints the picker lists for a small request now."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from gateway.epp.client import request_bodies, request_headers

    async def ask() -> str:
        from gateway.epp.client import Stream

        async with grpc.aio.insecure_channel(address) as channel:
            s = Stream(pb_grpc.ExternalProcessorStub(channel))
            await s.send(request_headers({}), *request_bodies(b'{"prompt": "hi"}', 1))
            answers = await s.wait(1)
            await s.close()
        if answers[0].WhichOneof("response") != "request_headers":
            return ""
        return answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value
    return asyncio.run(ask())
