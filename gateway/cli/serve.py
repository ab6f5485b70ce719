"""Run the SLO gateway in this process and its engine workers as child processes, all on this
machine: the gateway on --port, the workers on the ports after it (127.0.0.1 only). Without --model
the workers serve SmolLM2-135M-Instruct (--model smollm2). Every port is checked before anything
starts, and a worker that cannot start stops `serve` with the reason."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from gateway.cli.common import (
    MAX_PORT,
    CommandLineError,
    add_address,
    add_shutdown_timeout,
    bind,
    exit_on_sigterm,
)
from gateway.cli.options import (
    add_engine_options,
    add_server_options,
    check_model,
    to_argv,
    worker_options,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

WORKER_HOST = "127.0.0.1"
WORKER_EXIT_S = 3.0  # past this, a stopping worker is killed
log = logging.getLogger("flowprefill.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_address(parser, "address the gateway listens on (its workers listen on 127.0.0.1)",
                "the gateway's port; its engine workers take the ports after it")
    add_shutdown_timeout(parser)
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="engine worker processes (on the ports after --port); each gets (cores - 1) / "
                             "workers torch threads, at least one, unless --threads says otherwise")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="gateway TOML: SLO classes, API keys, rules, [upstream]")
    parser.add_argument("--disaggregate", action="store_true",
                        help="prefill/decode disaggregation: the first half of the workers prefill, the rest decode")
    add_server_options(parser)
    add_engine_options(parser, served=True)


@dataclass(frozen=True)
class Fleet:
    """The engine workers `serve` starts: one port and one role each."""

    ports: list[int]
    roles: list[str]

    @classmethod
    def plan(cls, args: argparse.Namespace) -> Fleet:
        if args.workers < 1:
            raise CommandLineError("--workers must be >= 1")
        if args.disaggregate and args.workers < 2:
            raise CommandLineError("--disaggregate needs --workers 2 or more (prefill and decode workers)")
        if args.port + args.workers > MAX_PORT:
            raise CommandLineError(f"--port {args.port} leaves no room for {args.workers} worker port(s) after it")
        n_prefill = args.workers // 2 if args.disaggregate else 0
        rest = "decode" if args.disaggregate else "colocated"
        return cls([args.port + 1 + i for i in range(args.workers)],
                   ["prefill"] * n_prefill + [rest] * (args.workers - n_prefill))

    def urls(self, *roles: str) -> list[str]:
        return [f"http://{WORKER_HOST}:{p}" for p, r in zip(self.ports, self.roles, strict=True) if r in roles]


def worker_threads(args: argparse.Namespace) -> int:
    # One core stays with the gateway (and the engine's own Python threads): on a 2-core host one torch
    # thread per worker gave more goodput than two, whose OpenMP teams wait for a descheduled thread at
    # every step's barrier.
    return args.num_threads or max(1, ((os.cpu_count() or 1) - 1) // args.workers)


@dataclass(frozen=True)
class Cores:
    """serve on a CPU: the cores the gateway (and the workers' HTTP threads) keep, and each worker's
    compute cores, disjoint, so that no worker's prefill waits for another's or for the gateway's Python
    (vLLM pins its compute thread likewise). A worker's process may also use `shared`, where its HTTP
    thread moves (engine/core/cpu_affinity.py)."""

    shared: set[int]
    own: list[set[int]]

    @classmethod
    def plan(cls, args: argparse.Namespace, threads: int) -> Cores | None:
        """--cpu-cores split among the workers; without it each worker takes `threads` cores after the
        first one allowed, which the gateway keeps (with any left over), or, when that leaves too few,
        from the first one on, the gateway sharing them. None: nothing is pinned (not a CPU, no affinity
        on this OS, or the workers do not fit in the cores at all)."""
        from engine.core.cpu_affinity import allowed_cores, parse_cores

        if args.device != "cpu" or not hasattr(os, "sched_setaffinity"):
            return None
        allowed = sorted(allowed_cores())
        try:
            pool = parse_cores(args.cpu_cores) if args.cpu_cores else allowed[1:]
        except ValueError as exc:
            raise CommandLineError(f"--cpu-cores {args.cpu_cores}: {exc}") from None
        per = len(pool) // args.workers if args.cpu_cores else threads
        if not args.cpu_cores and len(pool) < args.workers * per <= len(allowed):
            pool = allowed  # no core left for the gateway: it shares theirs (as vLLM's API server does)
        if per < 1 or len(pool) < args.workers * per:
            if args.cpu_cores:
                raise CommandLineError(f"--cpu-cores {args.cpu_cores}: fewer cores than --workers {args.workers}")
            return None
        own = [set(pool[i * per:(i + 1) * per]) for i in range(args.workers)]
        return cls(set(allowed) - set().union(*own) or set(allowed), own)


def _worker_argv(args: argparse.Namespace, port: int, role: str, cores: set[int] | None) -> list[str]:
    threads = args.num_threads or (len(cores) if cores else worker_threads(args))
    own = {"num_threads": threads, "cpu_cores": ",".join(map(str, sorted(cores))) if cores else args.cpu_cores}
    options = to_argv(argparse.Namespace(**{**vars(args), **own}), worker_options())
    config = ["--config", args.config] if args.config else []  # the classes' targets and late policies
    return [sys.executable, "-m", "gateway.cli", "worker", "--role", role, "--host", WORKER_HOST, "--port",
            str(port), "--shutdown-timeout", str(args.shutdown_timeout), *options, *config]


@contextmanager
def running(fleet: Fleet, args: argparse.Namespace) -> Iterator[Callable[[], None]]:
    """The fleet's workers, each healthy, for the `with` block, which gets what kills them at once (a
    second signal); stopped after it (or on failure), gracefully: they have nothing left in flight
    once the gateway has drained."""
    from rich.console import Console

    from gateway.processes import Relayed, wait_healthy

    cores = Cores.plan(args, worker_threads(args))
    own = cores.own if cores else [None] * len(fleet.ports)
    children = [Relayed(_worker_argv(args, port, role, mine), error_prefix="flowprefill worker: error: ",
                        cores=(cores.shared | mine) if cores and mine else None)
                for port, role, mine in zip(fleet.ports, fleet.roles, own, strict=True)]
    if cores:
        os.sched_setaffinity(0, cores.shared)  # the gateway's Python stays off the workers' compute cores
    try:
        with Console(stderr=True).status(f"starting {len(children)} engine worker(s)…"):
            for child, port in zip(children, fleet.ports, strict=True):
                try:
                    wait_healthy(f"http://{WORKER_HOST}:{port}", child.proc)
                except RuntimeError:  # it exited: a mistake it reported (exit 2) or a crash
                    raise CommandLineError(f"engine worker on port {port}: {child.cause()}",
                                           code=2 if child.proc.returncode == 2 else 1) from None
                except TimeoutError as exc:
                    raise CommandLineError(f"engine worker on port {port}: {exc}", code=1) from None
        def kill() -> None:
            for child in children:
                child.proc.kill()

        yield kill
    finally:
        for child in children:  # all at once: they drain in parallel
            child.proc.terminate()
        for child in children:
            try:  # a worker has nothing in flight once the gateway has drained: it exits in about 1 s
                child.proc.wait(timeout=WORKER_EXIT_S)
            except subprocess.TimeoutExpired:
                child.proc.kill()


def without_pointless_affinity(cfg: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """Prefix affinity off where the workers cache no prefixes (`--no-prefix-caching`): there it saves
    nothing and only overrides load, sending each new prompt to its rendezvous home unless that worker
    is 0.25 s behind. Simulated at 2 workers on azure-mix at 16 req/s (engine/sim/fleet.py, the
    gateway's own WorkerPool), which 2 ports the workers got moved attainment between 81.5 and 97.5 %
    (87.5 % by load alone)."""
    if args.prefix_caching or not cfg.prefix_affinity_chars:
        return cfg
    log.info("prefix affinity off: the workers run without prefix caching (prefix_affinity_chars %d ignored)",
             cfg.prefix_affinity_chars)
    return msgspec.structs.replace(cfg, prefix_affinity_chars=0)


def run(args: argparse.Namespace) -> int:
    from gateway.cli.gateway import load_config, serve_gateway
    from gateway.processes import PortInUse, check_free

    fleet = Fleet.plan(args)
    check_model(args.model)
    cfg = without_pointless_affinity(load_config(args.config, fleet.urls("colocated", "decode"),
                                                 fleet.urls("prefill") or None), args)
    sock = bind(args.host, args.port, "the gateway")  # held from here: nothing else takes it meanwhile
    for port in fleet.ports:
        try:
            check_free(WORKER_HOST, port)
        except PortInUse as exc:
            raise CommandLineError(f"engine worker on port {port}: {exc.strerror}") from None
    exit_on_sigterm()  # while the workers start; then the gateway's graceful shutdown takes over
    with running(fleet, args) as kill_workers:
        serve_gateway(cfg, sock, f"http://{args.host}:{args.port}", args.shutdown_timeout, at_once=kill_workers)
    return 0
