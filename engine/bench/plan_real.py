"""`flowprefill plan --against-serve N,N`: the planner's fleet against the real one on this machine.

For each policy and each N: `flowprefill serve --workers N` (the gateway and N engine workers, each
`--threads` torch threads, prefix caching off as in the simulation) is started, the workload's
arrivals are sent to it open loop (bench peer's client: streamed completions of one token, TTFT at
the client), and the planner simulates the same arrivals on N instances with the same prompts (so
the gateway's prefix keys, and with the workers' own URLs their rendezvous homes, are the real
ones) and the cost model profiled here. Per class, the two attainments side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
from typing import Any

from rich.console import Console

from engine.bench.plan import Planner, workers_of
from engine.bench.plan_routing import prompt_key
from engine.config import EngineConfig
from engine.model.plan import OpCost
from engine.protocol.slo import DEFAULT_CLASSES
from engine.request import Request
from gateway.processes import free_port, start, stop, wait_healthy
from loadtest import report
from loadtest.goodput import make_requests
from loadtest.peer.client import Arrival, Target, arrivals, model_name, replay
from loadtest.results import outcomes
from loadtest.workload import Workload


def real_point(policy: str, n: int, threads: int | None, w: Workload, schedule: list[Arrival]) -> tuple[
        dict[str, Any], list[str]]:
    """`serve --workers n` on the schedule: its goodput point, and its workers' URLs."""
    port = free_port(span=n + 1)
    argv = ["serve", "--port", str(port), "--workers", str(n), "--policy", policy, "--no-prefix-caching"]
    proc = start(*argv, *(["--threads", str(threads)] if threads else []))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=600)
        records = asyncio.run(replay(Target(url, model_name(url)), schedule, max_tokens=1, drain_s=120))
    finally:
        stop(proc)
    failed = sum(not r.ok for r in records)
    pt = report.point(w.rate, outcomes(records)) | {"failed": failed, "command": "flowprefill " + " ".join(argv)}
    return pt, [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)]


def against_serve(args: argparse.Namespace, w: Workload, cost: OpCost, engine_cfg: EngineConfig,
                  policies: list[str], console: Console) -> list[dict[str, Any]]:
    schedule = arrivals(w)

    def same_prompts() -> list[Request]:
        reqs = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
        for r, a in zip(reqs, schedule, strict=True):
            r.prompt_token_ids = a.prompt
        return reqs

    rows = []
    for policy in policies:
        for n in workers_of(args.against_serve):
            console.print(f"serve --workers {n} --policy {policy}: {len(schedule)} requests over "
                          f"{w.duration_s:.0f} s")
            real, urls = real_point(policy, n, args.threads, w, schedule)
            planner = Planner(w, copy.deepcopy(cost), engine_cfg, args.target, args.every_class,
                              key_of=prompt_key(args.prefix_affinity_chars) if args.prefix_affinity_chars else None,
                              poll_s=args.poll_s, requests=same_prompts, urls=lambda _n, urls=urls: urls)
            sim = planner.evaluate(policy, n, stop_early=False)
            rows.append({"policy": policy, "workers": n, "real": real, "sim": sim})
    return rows
