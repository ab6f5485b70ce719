"""`flowprefill bench gateway`: what the gateway adds over calling an engine worker directly.

A real worker and a real gateway in front of it run as separate processes, the gateway pinned to one
core. Latency: the same short request sent directly and through the gateway, alternating, one at a
time (non-streaming, and streaming: first token and last byte); the added latency is the difference
of the medians / p99s. Throughput on one core: the gateway's CPU seconds per proxied request, read from
/proc while concurrent clients drive it, inverted — what one core of gateway can proxy, whatever the
worker behind it manages (a CPU engine is the bottleneck here, not the gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from litestar import Litestar, Request, Response, get, post
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine.protocol.headers import (
    KV_BYTES_HEADER,
    KV_MS_HEADER,
    KV_TO_HEADER,
    KV_TRANSPORT_HEADER,
    REQUEST_ID_HEADER,
    SLO_CLASS_HEADER,
)
from gateway.cli.common import Parser
from gateway.cli.console import results_console
from gateway.netio import UpstreamTransport
from gateway.processes import free_port, start, stop, wait_healthy

BODY = {"prompt": [65, 66, 67, 68, 69, 70, 71, 72], "max_tokens": 1, "temperature": 0}
STREAM_BODY = BODY | {"max_tokens": 4, "stream": True, "ignore_eos": True}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _one(client: httpx.Client, url: str, stream: bool) -> tuple[float, float]:
    """(time to first token, time to last byte) in seconds."""
    t0 = time.perf_counter()
    if not stream:
        r = client.post(f"{url}/v1/completions", json=BODY)
        r.raise_for_status()
        t = time.perf_counter() - t0
        return t, t
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=STREAM_BODY) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


async def _drive(url: str, concurrency: int, seconds: float) -> int:
    done = 0
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=30) as client:
        async def user() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                (await client.post(f"{url}/v1/completions", json=BODY)).raise_for_status()
                done += 1
        await asyncio.gather(*(user() for _ in range(concurrency)))
    return done


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench gateway", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--requests", type=int, default=300, help="latency samples per path and mode")
    p.add_argument("--concurrency", type=int, default=32, help="clients for the throughput run")
    p.add_argument("--seconds", type=float, default=15.0, help="length of the throughput run")
    p.add_argument("--handoff-tokens", default="1024,4096,16384",
                   help="prompt lengths for the KV hand-off (PD disaggregation) cost; empty: skip")
    p.add_argument("--out", default="bench-results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = results_console()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    w_port, g_port = free_port(), free_port()
    worker = start("worker", "--model", "tiny", "--port", str(w_port), "--threads", "1", core=cores[-1])
    gateway = start("gateway", "--workers", f"http://127.0.0.1:{w_port}", "--port", str(g_port), core=cores[0])
    direct, via = f"http://127.0.0.1:{w_port}", f"http://127.0.0.1:{g_port}"
    results: dict[str, Any] = {"command": "flowprefill bench gateway " + " ".join(argv or sys.argv[3:]),
                               "cores": len(cores), "gateway_core": cores[0], "worker_core": cores[-1]}
    try:
        with console.status("starting a worker and a gateway…"):
            wait_healthy(direct, worker)
            wait_healthy(via, gateway)
        with httpx.Client(timeout=30) as client, Progress(console=console) as progress:
            task = progress.add_task("latency", total=4 * args.requests)
            for stream in (False, True):
                for _ in range(20):  # warm-up: connections, the engine's first batches
                    _one(client, direct, stream), _one(client, via, stream)
                samples: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
                cpu0 = _cpu_s(gateway.pid)
                for i in range(args.requests):
                    order = (("direct", direct), ("gateway", via)) if i % 2 else (("gateway", via), ("direct", direct))
                    for name, url in order:
                        samples[name].append(_one(client, url, stream))
                        progress.advance(task)
                results["streaming" if stream else "non_streaming"] = _latency(samples, stream)
                if not stream:  # the gateway idles while the direct requests run: its CPU is theirs
                    gateway_ms = 1000 * (_cpu_s(gateway.pid) - cpu0) / args.requests
        with console.status("where the time goes: Litestar's floor and the upstream client alone…"):
            gap_s = results["non_streaming"]["total"]["direct_p50_ms"] / 1000
            results["breakdown"] = _breakdown(direct, gateway_ms, args.requests, cores[0], gap_s)
        with console.status(f"throughput: {args.concurrency} clients for {args.seconds:g} s through the gateway…"):
            cpu0, t0 = _cpu_s(gateway.pid), time.monotonic()
            n = asyncio.run(_drive(via, args.concurrency, args.seconds))
            cpu, wall = _cpu_s(gateway.pid) - cpu0, time.monotonic() - t0
        results["throughput"] = {"requests": n, "seconds": wall, "achieved_rps": n / wall,
                                 "gateway_cpu_s": cpu, "gateway_cpu_ms_per_request": 1000 * cpu / n,
                                 "one_core_capacity_rps": n / cpu if cpu else float("inf")}
        if args.handoff_tokens:
            results["handoff"] = _handoff(console, direct, [int(x) for x in args.handoff_tokens.split(",")], cores)
    finally:
        for proc in (gateway, worker):
            stop(proc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps(results, indent=2))
    _table(console, results)
    _plot(results, out / "gateway.png")
    console.print(f"wrote {out / 'gateway.json'} and {out / 'gateway.png'}")
    return 0


def _handoff(console: Console, prefill: str, lengths: list[int], cores: list[int]) -> list[dict[str, Any]]:
    """PD disaggregation: what handing a prompt's KV to a decode worker costs, per prompt length and
    transport (shared memory, as a same-host hand-off goes, and HTTP, as across hosts), alternating.
    The prefill worker reports the bytes and the time from packing to the decode worker's 204."""
    d_port = free_port()
    decode = start("worker", "--model", "tiny", "--port", str(d_port), "--threads", "1", core=cores[0])
    rows = []
    try:
        with console.status("KV hand-off: starting a decode worker…"):
            wait_healthy(f"http://127.0.0.1:{d_port}", decode)
        with httpx.Client(timeout=300) as client:
            for n in lengths:
                ms: dict[str, list[float]] = {"shm": [], "http": []}
                total: dict[str, list[float]] = {"shm": [], "http": []}
                for i in range(5):
                    for transport in ("shm", "http") if i % 2 else ("http", "shm"):
                        t0 = time.perf_counter()
                        r = client.post(f"{prefill}/v1/completions", headers={
                            KV_TO_HEADER: f"http://127.0.0.1:{d_port}",
                            REQUEST_ID_HEADER: f"h{n}-{transport}-{i}",
                            KV_TRANSPORT_HEADER: "http" if transport == "http" else "auto"},
                            json={"prompt": [65 + (j % 26) for j in range(n)], "max_tokens": 1})
                        r.raise_for_status()
                        if r.headers[KV_TRANSPORT_HEADER] != transport:
                            raise RuntimeError(f"asked for {transport}, the worker used "
                                               f"{r.headers[KV_TRANSPORT_HEADER]}")
                        total[transport].append((time.perf_counter() - t0) * 1000)
                        ms[transport].append(float(r.headers[KV_MS_HEADER]))
                        kv_bytes = int(r.headers[KV_BYTES_HEADER])
                for transport in ("shm", "http"):
                    p50 = float(np.median(ms[transport]))
                    rows.append({"prompt_tokens": n, "transport": transport, "kv_bytes": kv_bytes,
                                 "bytes_per_token": kv_bytes / n, "handoff_ms_p50": p50, "us_per_token": 1000 * p50 / n,
                                 "prefill_request_ms_p50": float(np.median(total[transport])),
                                 "share_of_prefill_request": p50 / float(np.median(total[transport]))})
    finally:
        stop(decode)
    return rows


def floor_app() -> Any:
    """The least a Litestar app under uvicorn can do per request: read the body, answer a fixed
    completion. What any Litestar gateway pays before doing anything."""
    answer = json.dumps({"id": "cmpl-x", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}]}).encode()

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response:
        await request.body()
        return Response(answer, media_type="application/json", headers={REQUEST_ID_HEADER: "x"})

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return Litestar([completions, health], openapi_config=None)


def _breakdown(worker_url: str, gateway_ms: float, n: int, core: int, gap_s: float) -> dict[str, float]:
    """CPU per sequential request: the gateway, a bare Litestar app on its core, and the gateway's
    upstream client alone sending the same request to the worker; the rest is the gateway's own work.
    The bare app is timed twice: back to back, and with the other core busy for `gap_s` (the
    worker's time) after each request, as it is while the gateway waits on a computing engine."""
    port = free_port()
    floor = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "gateway.bench:floor_app", "--port",
                              str(port), "--log-level", "warning", "--no-access-log"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", floor)
        with httpx.Client() as client:
            for _ in range(50):
                _one(client, f"http://127.0.0.1:{port}", False)
            floor_ms = {}
            for gap in (0.0, gap_s):
                cpu0 = _cpu_s(floor.pid)
                for _ in range(n):
                    _one(client, f"http://127.0.0.1:{port}", False)
                    until = time.perf_counter() + gap
                    while time.perf_counter() < until:  # computing, as the engine does meanwhile
                        pass
                floor_ms[gap] = 1000 * (_cpu_s(floor.pid) - cpu0) / n
    finally:
        stop(floor)

    async def client_alone() -> float:
        transport = UpstreamTransport(httpx.Limits(max_connections=4))
        body = json.dumps(BODY).encode()
        headers = {"content-type": "application/json", SLO_CLASS_HEADER: "standard", REQUEST_ID_HEADER: "b"}
        timeout = httpx.Timeout(30).as_dict()
        cpu = 0.0
        for i in range(n + 50):
            t0 = time.thread_time()
            up = await transport.post(f"{worker_url}/v1/completions", body, headers, timeout)  # as the gateway
            await up.aread()
            await up.aclose()
            cpu += (time.thread_time() - t0) if i >= 50 else 0.0  # the thread's CPU: waiting is free
        await transport.aclose()
        return 1000 * cpu / n

    try:  # the event loop uvicorn runs the gateway on, where it is installed
        import uvloop
        client_ms = uvloop.run(client_alone())
    except ImportError:
        client_ms = asyncio.run(client_alone())
    return {"gateway_cpu_ms": gateway_ms, "litestar_floor_cpu_ms": floor_ms[0.0],
            "litestar_floor_busy_neighbour_cpu_ms": floor_ms[gap_s], "upstream_client_cpu_ms": client_ms,
            "own_work_cpu_ms": gateway_ms - floor_ms[gap_s] - client_ms}


def _latency(samples: dict[str, list[tuple[float, float]]], stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"raw_ms": {k: [[round(a * 1000, 4), round(b * 1000, 4)] for a, b in v]
                                      for k, v in samples.items()}}
    for idx, what in ((0, "ttft"), (1, "total")) if stream else ((1, "total"),):
        d = np.array([s[idx] for s in samples["direct"]]) * 1000
        g = np.array([s[idx] for s in samples["gateway"]]) * 1000
        out[what] = {"direct_p50_ms": float(np.median(d)), "gateway_p50_ms": float(np.median(g)),
                     "direct_p99_ms": float(np.percentile(d, 99)), "gateway_p99_ms": float(np.percentile(g, 99)),
                     "added_p50_ms": float(np.median(g) - np.median(d)),
                     "added_p99_ms": float(np.percentile(g, 99) - np.percentile(d, 99))}
    return out


def _table(console: Console, r: dict[str, Any]) -> None:
    t = Table(title="gateway overhead (added = through the gateway - direct to the worker)")
    for col in ("request", "direct p50 ms", "gateway p50 ms", "added p50 ms", "added p99 ms"):
        t.add_column(col, justify="left" if col == "request" else "right")
    for mode, what in (("non_streaming", "total"), ("streaming", "ttft"), ("streaming", "total")):
        x = r[mode][what]
        t.add_row(f"{mode.replace('_', '-')} {what}", f"{x['direct_p50_ms']:.2f}", f"{x['gateway_p50_ms']:.2f}",
                  f"{x['added_p50_ms']:.2f}", f"{x['added_p99_ms']:.2f}")
    console.print(t)
    if r.get("handoff"):
        h = Table(title="KV hand-off to a decode worker (PD disaggregation; same host: shared memory, "
                  "else HTTP)")
        for col in ("prompt tokens", "transport", "KV MB", "bytes/token", "hand-off ms", "µs/token",
                    "share of prefill request"):
            h.add_column(col, justify="right")
        for row in r["handoff"]:
            h.add_row(str(row["prompt_tokens"]), row.get("transport", "http"), f"{row['kv_bytes'] / 1e6:.1f}",
                      f"{row['bytes_per_token']:.0f}", f"{row['handoff_ms_p50']:.1f}", f"{row['us_per_token']:.2f}",
                      f"{row['share_of_prefill_request']:.0%}")
        console.print(h)
    if b := r.get("breakdown"):
        w = Table(title="where the gateway's CPU goes (ms per request, one request at a time)")
        for col in ("Litestar floor, back to back", "Litestar floor, engine computing", "upstream call",
                    "the rest", "gateway total"):
            w.add_column(col, justify="right")
        w.add_row(*(f"{b[k]:.3f}" for k in ("litestar_floor_cpu_ms", "litestar_floor_busy_neighbour_cpu_ms",
                                             "upstream_client_cpu_ms", "own_work_cpu_ms", "gateway_cpu_ms")))
        console.print(w)
    th = r["throughput"]
    console.print(f"throughput: {th['achieved_rps']:.0f} req/s achieved (the worker's limit); the gateway used "
                  f"{th['gateway_cpu_ms_per_request']:.3f} ms of CPU per request = "
                  f"[bold]{th['one_core_capacity_rps']:.0f} req/s[/] on one core")


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (mode, idx, title) in zip(axes, (("non_streaming", 1, "non-streaming, end to end"),
                                             ("streaming", 0, "streaming, first token")), strict=True):
        for name, color in (("direct", "C0"), ("gateway", "C1")):
            v = np.sort([s[idx] for s in r[mode]["raw_ms"][name]])
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=color, label=name)
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"gateway adds {r['non_streaming']['total']['added_p50_ms']:.2f} ms at p50; "
                 f"{r['throughput']['one_core_capacity_rps']:.0f} req/s per core")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
