"""`flowprefill bench health`: how long a worker's event loop leaves GET /health waiting while a burst of
requests arrives. Every HTTP request, a health probe included, waits behind whatever the event loop does;
scheduling decisions belong on the engine thread, so that a burst of arrivals never holds the probes
(a Kubernetes liveness probe that times out restarts the pod).

A worker (tiny model unless --model, one compute thread) is started, or one at --url is used; a probe
asks /health every --probe-ms on its own connection while --burst requests (short prompts, one token
each, the default class) arrive at once. Prints the probes' latency before and during the burst, writes
JSON and a PNG of every probe's latency over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from gateway.cli.common import Parser
from gateway.cli.console import results_console
from gateway.processes import free_port, start, stop, wait_healthy


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench health", description=__doc__)
    p.add_argument("--url", help="a running worker's base URL (default: start one)")
    p.add_argument("--model", default="tiny", help="the started worker's --model (default: tiny)")
    p.add_argument("--burst", type=int, default=400, help="requests sent at once (default: 400)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="each burst request's prompt (default: 64)")
    p.add_argument("--probe-ms", type=float, default=5.0, help="interval of /health probes (default: 5)")
    p.add_argument("--threads", type=int, default=1, help="the started worker's compute threads (default: 1)")
    p.add_argument("--out", type=Path, default=Path("bench-health"), help="folder for health.json and health.png")
    return p


async def _probe(client: httpx.AsyncClient, url: str, every_s: float, stop_at: asyncio.Event,
                 out: list[tuple[float, float]]) -> None:
    t_start = time.perf_counter()
    while not stop_at.is_set():
        t0 = time.perf_counter()
        r = await client.get(f"{url}/health")
        r.raise_for_status()
        out.append((t0 - t_start, (time.perf_counter() - t0) * 1000))
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - t0)))


async def _run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    probes: list[tuple[float, float]] = []
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=args.burst + 8)
    async with httpx.AsyncClient(timeout=600) as probe_client, httpx.AsyncClient(timeout=600, limits=limits) as c:
        body = {"prompt": [65 + i % 26 for i in range(args.prompt_tokens)], "max_tokens": 1, "ignore_eos": True}
        await c.post(f"{url}/v1/completions", json=body)  # warm: the first request's one-off costs
        task = asyncio.create_task(_probe(probe_client, url, args.probe_ms / 1000, done, probes))
        await asyncio.sleep(1.0)  # probes of the idle worker first
        burst_at = probes[-1][0] if probes else 0.0
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.post(f"{url}/v1/completions", json=body) for _ in range(args.burst)))
        burst_s = time.perf_counter() - t0
        done.set()
        await task
    statuses: dict[str, int] = {}
    for r in answers:
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
    idle = [ms for t, ms in probes if t <= burst_at]
    during = [ms for t, ms in probes if t > burst_at]

    def stats(xs: list[float]) -> dict[str, float | int]:
        return {"n": len(xs), "p50_ms": float(np.percentile(xs, 50)), "p99_ms": float(np.percentile(xs, 99)),
                "max_ms": max(xs)} if xs else {"n": 0}

    return {"burst": args.burst, "prompt_tokens": args.prompt_tokens, "probe_ms": args.probe_ms,
            "burst_s": burst_s, "statuses": statuses, "idle": stats(idle), "during_burst": stats(during),
            "probes": probes, "burst_at_s": burst_at}


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ts, ms = zip(*doc["probes"], strict=True) if doc["probes"] else ((), ())
    ax.plot(ts, ms, ".", ms=3)
    ax.axvline(doc["burst_at_s"], color="grey", ls="--", label=f"{doc['burst']} requests arrive")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GET /health latency (ms)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = results_console()
    proc = None
    url = args.url
    try:
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            console.print(f"starting a worker ({args.model}, {args.threads} thread) on {url} ...")
            proc = start("worker", "--port", str(port), "--model", args.model, "--threads", str(args.threads))
            wait_healthy(url, proc, timeout=300)
        console.print(f"probing {url}/health every {args.probe_ms:g} ms; a burst of {args.burst} requests ...")
        doc = asyncio.run(_run(url, args))
    finally:
        if proc is not None:
            stop(proc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "health.json").write_text(json.dumps(doc, indent=1))
    _plot(doc, args.out / "health.png")
    from rich.table import Table

    t = Table(title=f"GET /health latency, {doc['burst']} requests at once (answered in {doc['burst_s']:.1f} s, "
              f"statuses {doc['statuses']})")
    for col in ("when", "probes", "p50 ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    for name in ("idle", "during_burst"):
        s = doc[name]
        if s["n"]:
            t.add_row(name.replace("_", " "), str(s["n"]), f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}",
                      f"{s['max_ms']:.2f}")
    console.print(t)
    console.print(f"wrote {args.out / 'health.json'} and {args.out / 'health.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
