"""Real `flowprefill serve` fleets run on this machine: a planner's pilot (engine/planner/speed.py) and
`flowprefill bench planner`'s real fleets (engine/bench/planner_validation/) alike.

`real_point` starts `serve --workers N` (the gateway and N engine workers, each `--threads` torch threads,
prefix caching off as in the simulation, its workers logging their batches, engine/core/batch_log.py),
sends it a schedule of arrivals open loop (bench peer's client: streamed completions of one token, TTFT
at the client) and reads back its goodput point, its workers' URLs and the batches they ran.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.core.batch_log import ENV as BATCH_LOG
from engine.core.batch_log import MeasuredBatch, read_workers
from engine.planner.measured import idle_wake, net_of_serving, net_of_wake, overheads
from gateway.cli.serve import Cores, worker_threads
from gateway.processes import free_port, last_line, start, stop, wait_healthy
from loadtest import report
from loadtest.peer.client import Arrival, Target, model_name, replay
from loadtest.results import outcomes
from loadtest.server import ServerCounters
from loadtest.workload import Workload

Run = tuple[dict[str, Any], list[str], list[MeasuredBatch]]  # a real run: its point, its workers' URLs, its batches


def fleet_name(policy: str, n: int) -> str:
    """A point's folder name under `<out>/batch-logs/`, e.g. `chunked-2048-w2`."""
    return f"{policy.replace(':', '-')}-w{n}"


def real_point(policy: str, n: int, threads: int | None, w: Workload, schedule: list[Arrival], logs: Path) -> Run:
    """`serve --workers n` on the schedule, its workers logging their batches in `logs`: its goodput
    point (with the workers' host time per batch, the requests' time outside them, and the serving
    side's CPU per request), its workers' URLs, and the batches they ran, each less what the serving
    side took from it (`net_of_serving`) and, begun on an idle worker, less what that cost it (`idle_wake`,
    `net_of_wake`; request ids as the simulation's: `w{i}` for the schedule's i-th arrival)."""
    logs.mkdir(parents=True, exist_ok=True)  # real_rounds emptied it: an earlier run's logs are not read
    proc, port, argv = _start_serve(policy, n, threads, logs)
    url = f"http://127.0.0.1:{port}"
    try:
        counters = ServerCounters(url)  # the workers' CPU: their serving side's share is the runs' too
        with off_the_workers_cores(n, threads):
            records = asyncio.run(replay(Target(url, model_name(url)), schedule, max_tokens=1, drain_s=120))
        preempted, cpu = counters.stop()
    finally:
        stop(proc)
    workers = [[b._replace(ids=[_sim_id(rid) for rid in b.ids]) for b in bs] for bs in read_workers(logs)]
    failed = sum(not r.ok for r in records)
    pt = report.point(w.rate, outcomes(records), sum((preempted or {}).values())) | {
        "failed": failed, "command": "flowprefill " + " ".join(argv)}
    pt |= overheads(workers, {f"w{r.index}": r.ttft_s for r in records if r.ttft_s is not None and r.ok})
    pt["serving_cpu_ms"] = cpu["serving_s"] * 1000 / len(records) if cpu and records else None
    served = [net_of_serving(bs, (pt["serving_cpu_ms"] or 0.0) / 1000) for bs in workers]
    # Where the workers share their cores with the gateway (two workers on 2 cores), a batch begun idle is
    # also one that ran while the rest of the fleet was quiet, faster: its excess is not the wake-up alone.
    # So it is netted out for one worker (over nine runs' pilots: 53 of 54 cells within 5 points, 50 without)
    # and not for two workers on 2 cores (48 of 54 with it, 50 without).
    wake_s = idle_wake(served) if gateway_cores(n, threads) is not None else None
    pt["idle_wake_ms"] = None if wake_s is None else wake_s * 1000
    batches = [b for bs in served for b in net_of_wake(bs, wake_s or 0.0)]
    return pt, [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)], batches


def gateway_cores(n: int, threads: int | None) -> set[int] | None:
    """The cores `serve --workers n` keeps for its gateway apart from its workers' own, or None where the
    gateway shares theirs (serve's own split of this machine's cores)."""
    serve_args = argparse.Namespace(device="cpu", cpu_cores=None, workers=n, num_threads=threads)
    cores = Cores.plan(serve_args, worker_threads(serve_args))
    if cores is None or cores.shared & set().union(*cores.own):
        return None
    return set(cores.shared)


@contextmanager
def off_the_workers_cores(n: int, threads: int | None) -> Iterator[None]:
    """The load generator (this process) on the gateway's cores while `serve --workers n` runs, where
    serve pins its workers to cores of their own (it keeps the first core for the gateway when the
    rest hold every worker: on 2 cores, one worker of one thread), as a deployment's clients are not on
    its workers' cores. Unpinned, the replay's own Python shared the one worker's core at 16 req/s.
    (The calling thread is pinned, and so the replay's event loop and any thread it starts.)"""
    shared = gateway_cores(n, threads)
    if shared is None:
        yield  # the gateway shares the workers' cores: nowhere else to go
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, shared)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _start_serve(policy: str, n: int, threads: int | None, logs: Path, tries: int = 3
                 ) -> tuple[subprocess.Popen, int, list[str]]:
    """`serve --workers n` started and healthy, its stderr in `logs/serve-<attempt>.log`. A port free when chosen can
    be taken before serve binds it (the replay's connections come and go on this machine's ports: one of
    four fleets in a run at 16 req/s exited 2, cause unseen); serve then refuses to start, and another
    port is tried. Any other early exit is an error that names serve's own last line."""
    for attempt in range(tries):
        port = free_port(span=n + 1)
        # --no-calibrate: the workers predict with the profile this planner reads (not each a start-up of its
        # own, 13 % apart per operator on 2 EPYC cores), so their logged speeds carry over to its cost model
        # --model tiny: the model the planner's profile is of (an engine's default, not serve's)
        argv = ["serve", "--model", "tiny", "--port", str(port), "--workers", str(n), "--policy", policy,
                "--no-prefix-caching", "--no-calibrate", *(["--threads", str(threads)] if threads else [])]
        log = logs / f"serve-{attempt}.log"  # its own: an earlier attempt's last line is not this one's cause
        proc = start(*argv, env={BATCH_LOG: str(logs)}, stderr_to=log)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=600)
            return proc, port, argv
        except (RuntimeError, TimeoutError) as exc:
            stop(proc)
            why = last_line(log)
            if "in use" in why and attempt + 1 < tries:
                continue
            raise RuntimeError(f"flowprefill {' '.join(argv)}: {exc}: {why} (its log: {log})") from None
        except BaseException:  # interrupted while it starts: it and its workers are not left running
            stop(proc)
            raise
    raise AssertionError("unreachable")


def _sim_id(worker_id: str) -> str:
    """The replay client's `peer-<ns>-<i>` (a worker may add `-<hex>` to a reused id) as the simulation's `w<i>`."""
    parts = worker_id.split("-")
    return f"w{parts[2]}" if len(parts) >= 3 and parts[0] == "peer" and parts[2].isdecimal() else worker_id
