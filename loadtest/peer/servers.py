"""The contenders of `flowprefill bench peer` and the servers behind them: vLLM (or SGLang) started
from the Python of its own install, `flowprefill serve`, and `flowprefill gateway --upstream openai` in
front of a vLLM server. Every process of every contender is pinned to the same cores (the engines'
core budget); each server's output goes to a log file next to the results.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gateway.processes import free_port, wait_healthy

PEERS = ("vllm", "sglang")


class SpecError(ValueError):
    """A contender list that cannot run, with what is wrong."""


@dataclass(frozen=True)
class Placement:
    """Where the servers run: their cores (every process pinned there, cpu only), how many compute
    threads each engine gets, and the device."""

    cores: tuple[int, ...]
    threads: int
    device: str = "cpu"

    def describe(self) -> str:
        if self.device != "cpu":
            return f"{self.device}, {self.threads} CPU thread(s)"
        return f"cores {cores_arg(self.cores)} ({self.threads} thread(s) per engine), every server process pinned"

    def pin(self) -> None:
        if self.device == "cpu" and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(self.cores))


def cores_arg(cores: tuple[int, ...]) -> str:
    """"1" / "0-3" / "0,2": what taskset and VLLM_CPU_OMP_THREADS_BIND read."""
    if len(cores) > 1 and list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration. kind vllm / sglang: `policy` priority or fcfs, `budget` the chunked
    prefill token budget, `long_cap` (vLLM) its --long-prefill-token-threshold: the most tokens of a
    step a long prefill takes while other requests wait (0: all of it); kind flowprefill: `policy` is
    its --policy."""

    kind: str
    policy: str = "priority"
    budget: int | None = None
    long_cap: int = 0

    @property
    def name(self) -> str:
        if self.kind == "flowprefill":
            return "flowprefill" if self.policy == "flowprefill" else f"flowprefill-{self.policy}"
        return f"{self.kind}-{self.policy}-{self.budget}" + (f"-long{self.long_cap}" if self.long_cap else "")


@dataclass(frozen=True)
class Contender:
    """What the client talks to: a server directly, or our gateway in front of it."""

    server: ServerSpec
    via_gateway: bool = False
    reserve: int | None = None  # the gateway's --reserve-tokens (None: its default)
    tokens: int | None = None  # the gateway's --max-tokens-in-flight (None: the launch's, `Launch.gateway_tokens`)
    slack: str | None = None  # the gateway's --slack (None: its default)
    backfill: str | None = None  # the gateway's --backfill (None: its default)

    @property
    def name(self) -> str:
        options = {"reserve": self.reserve, "tokens": self.tokens, "slack": self.slack, "backfill": self.backfill}
        gateway = "gateway" + "".join(f"-{k}{v}" for k, v in options.items() if v is not None)
        return f"{gateway}+{self.server.name}" if self.via_gateway else self.server.name

    @property
    def sends_priority(self) -> bool:
        """The client writes the class as the body's `priority` (a peer served directly); our servers
        read `x-slo-class`, and the gateway writes the priority itself (gateway/app.py)."""
        return self.server.kind in PEERS and not self.via_gateway

    @property
    def is_peer_alone(self) -> bool:
        return self.server.kind in PEERS and not self.via_gateway


GATEWAY_OPTIONS = ("gateway/N (its --reserve-tokens), gateway/tokens=N, gateway/slack=observed|deadline, "
                   "gateway/backfill=on|off")
CHOICES = {"slack": ("observed", "deadline"), "backfill": ("on", "off")}


class GatewayOptions(NamedTuple):
    """`gateway/512/tokens=3072/slack=deadline:...`: the gateway's own flags for one contender (None: its default)."""

    reserve: int | None = None
    tokens: int | None = None
    slack: str | None = None
    backfill: str | None = None

    @classmethod
    def parse(cls, item: str, options: list[str]) -> GatewayOptions:
        given: dict[str, str] = {}
        for option in options:
            name, value = option.split("=", 1) if "=" in option else ("reserve", option)
            if name in given:
                raise SpecError(f"contender {item!r}: the gateway's {name} is given twice")
            if not (value in CHOICES.get(name, ())
                    or (name in ("reserve", "tokens") and value.isdecimal() and value.isascii())):
                raise SpecError(f"contender {item!r}: {option!r} is not one of {GATEWAY_OPTIONS} (N >= 0)")
            given[name] = value
        number = {k: int(v) for k, v in given.items() if k not in CHOICES}
        return cls(number.get("reserve"), number.get("tokens"), given.get("slack"), given.get("backfill"))


def parse_contenders(spec: str) -> list[Contender]:
    """`vllm:priority:512,vllm:fcfs:2048,gateway:vllm:priority:2048,flowprefill` (see --contenders);
    `gateway/N:...`: the gateway with `--reserve-tokens N`; `gateway/tokens=N:...` with
    `--max-tokens-in-flight N`, `gateway/slack=deadline:...` with `--slack deadline`, `gateway/backfill=off:...` with
    `--backfill off` (combined with `/`)."""
    out: list[Contender] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        parts = item.split(":")
        head, *options = parts[0].split("/")
        via = head == "gateway"
        if via:
            parts = parts[1:]
        elif options:
            raise SpecError(f"contender {item!r}: only the gateway takes options ({GATEWAY_OPTIONS})")
        gateway = GatewayOptions.parse(item, options)
        kind = parts[0] if parts else ""
        if kind == "flowprefill" and not via:
            out.append(Contender(ServerSpec("flowprefill", parts[1] if len(parts) > 1 else "flowprefill")))
            continue
        if kind not in PEERS or len(parts) > 4 or (len(parts) > 3 and kind != "vllm"):
            raise SpecError(f"contender {item!r}: expected vllm|sglang[:priority|fcfs[:TOKENS]], "
                            "vllm:POLICY:TOKENS:LONG_CAP, gateway:vllm|sglang[:...] or flowprefill[:POLICY]")
        policy = parts[1] if len(parts) > 1 else "priority"
        if policy not in ("priority", "fcfs"):
            raise SpecError(f"contender {item!r}: policy {policy!r} is not priority or fcfs")
        try:
            budget = int(parts[2]) if len(parts) > 2 else 2048
            cap = int(parts[3]) if len(parts) > 3 else 0
        except ValueError:
            raise SpecError(f"contender {item!r}: its token budget and long-prefill cap must be integers") from None
        if budget < 16 or not 0 <= cap <= budget:
            raise SpecError(f"contender {item!r}: token budget must be >= 16, the long-prefill cap within it")
        if gateway.reserve and gateway.reserve >= (budget if gateway.tokens is None else gateway.tokens):
            raise SpecError(f"contender {item!r}: the gateway's reserve must be under its token budget")
        out.append(Contender(ServerSpec(kind, policy, budget, cap), via, **gateway._asdict()))
    if len({c.name for c in out}) != len(out):
        raise SpecError(f"contenders {spec!r} name one twice")
    if not out:
        raise SpecError("no contenders")
    return out


@dataclass(frozen=True)
class Launch:
    """How to start the servers: the checkpoint, dtype, where, and the peers' Pythons."""

    model: Path
    dtype: str
    placement: Placement
    pythons: dict[str, str]  # kind -> python executable
    logs: Path
    max_model_len: int = 16384
    vllm_kv_gib: int = 1
    gateway_concurrency: int = 64  # the peer benchmark's default (loadtest/peer/cli.py)
    gateway_tokens: int | None = None  # the gateway's --max-tokens-in-flight (None: the server's budget)
    # On a GPU every server stays up for the whole sweep, on one device: vLLM takes 90 % of its memory by
    # default (SGLang most of it too), so a second peer server could not start. Each peer server is given
    # this fraction over their number (vLLM's --gpu-memory-utilization, a share of the device's memory;
    # SGLang's --mem-fraction-static, measured against what is free when it starts), and the servers start
    # one at a time there (`fleet`): one that sizes its KV cache while a neighbour loads counts the
    # neighbour's memory as its own. FlowPrefill's KV cache is a fixed number of tokens (engine/core/config.py).
    gpu_share: float = 0.8

    def argv(self, spec: ServerSpec, port: int, peers_on_device: int = 1) -> list[str]:
        """`peers_on_device`: how many peer servers share the GPU (each gets its part of `gpu_share`)."""
        p = self.placement
        fraction = f"{self.gpu_share / max(1, peers_on_device):.3f}"
        if spec.kind == "flowprefill":
            return [sys.executable, "-m", "gateway.cli", "serve", "--model", str(self.model), "--port", str(port),
                    "--threads", str(p.threads), "--dtype", self.dtype, "--device", p.device,
                    "--policy", spec.policy, "--no-prefix-caching"]
        if spec.kind == "vllm":
            return [self.pythons["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                    "--served-model-name", "peer", "--host", "127.0.0.1", "--port", str(port),
                    "--dtype", self.dtype, "--scheduling-policy", spec.policy, "--enable-chunked-prefill",
                    "--max-num-batched-tokens", str(spec.budget), "--no-enable-prefix-caching",
                    "--max-model-len", str(self.max_model_len), "--disable-log-stats",
                    "--uvicorn-log-level", "warning",
                    *(["--long-prefill-token-threshold", str(spec.long_cap)] if spec.long_cap else []),
                    *(["--gpu-memory-utilization", fraction] if p.device != "cpu" else [])]
        # SGLang: lower priority values first, as vLLM (its default is the reverse); any priority
        # difference may preempt (its default threshold, 10, is more than our classes span).
        argv = [self.pythons["sglang"], "-m", "sglang.launch_server", "--model-path", str(self.model),
                "--served-model-name", "peer", "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                "--chunked-prefill-size", str(spec.budget), "--disable-radix-cache",
                "--context-length", str(self.max_model_len)]
        argv += ["--device", "cpu"] if p.device == "cpu" else ["--mem-fraction-static", fraction]
        if spec.policy == "priority":
            argv += ["--enable-priority-scheduling", "--schedule-low-priority-values-first",
                     "--priority-scheduling-preemption-threshold", "1"]
        return argv

    def env(self, spec: ServerSpec) -> dict[str, str]:
        p = self.placement
        env = {"OMP_NUM_THREADS": str(p.threads)}
        if spec.kind in PEERS and p.device == "cpu":
            env |= {"VLLM_CPU_OMP_THREADS_BIND": cores_arg(p.cores), "VLLM_CPU_KVCACHE_SPACE": str(self.vllm_kv_gib),
                    "SGLANG_CPU_OMP_THREADS_BIND": cores_arg(p.cores)}
        return env

    def gateway_argv(self, contender: Contender, upstream_url: str, port: int) -> list[str]:
        tokens = contender.tokens if contender.tokens is not None else self.gateway_tokens
        tokens = (contender.server.budget or 0) if tokens is None else tokens
        return [sys.executable, "-m", "gateway.cli", "gateway", "--workers", upstream_url, "--upstream", "openai",
                "--port", str(port), "--max-concurrency", str(self.gateway_concurrency),
                "--max-tokens-in-flight", str(tokens),
                *(["--reserve-tokens", str(contender.reserve)] if contender.reserve is not None else []),
                *(["--slack", contender.slack] if contender.slack is not None else []),
                *(["--backfill", contender.backfill] if contender.backfill is not None else [])]


class Process:
    """A started server: its own session (so stopping it stops all its children), pinned, logging."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], launch: Launch, port: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        launch.logs.mkdir(parents=True, exist_ok=True)
        self.log = launch.logs / f"{name}.log"
        with self.log.open("w") as log:
            log.write(" ".join(argv) + "\n")
            log.flush()
            self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=launch.placement.pin)

    def wait(self, timeout_s: float) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout=timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log.read_text(errors="replace").splitlines()[-15:]
            raise ServerError(f"{self.name}: {exc}; the end of {self.log}:\n" + "\n".join(tail)) from None

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the process group (vLLM's engine core and workers are children), then SIGKILL."""
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children that outlived their parent
        self.proc.wait()


class ServerError(RuntimeError):
    pass


@contextmanager
def fleet(contenders: list[Contender], launch: Launch, start_timeout_s: float = 900) -> Iterator[dict[str, str]]:
    """Every server the contenders need, started together and stopped on exit: contender -> URL.
    A gateway contender fronts the peer server of the same configuration (started once)."""
    servers: dict[ServerSpec, Process] = {}
    gateways: dict[str, Process] = {}
    try:
        specs = list(dict.fromkeys(c.server for c in contenders))
        peers = sum(spec.kind in PEERS for spec in specs)
        for spec in specs:
            port = free_port(span=2)  # serve puts its worker on the next port
            servers[spec] = Process(spec.name, launch.argv(spec, port, peers), launch.env(spec), launch, port)
            if launch.placement.device != "cpu":
                servers[spec].wait(start_timeout_s)  # one device: each sizes its memory with the others loaded
        for p in servers.values():
            p.wait(start_timeout_s)
        for c in contenders:
            if c.via_gateway:
                port = free_port()
                argv = launch.gateway_argv(c, servers[c.server].url, port)
                gateways[c.name] = Process(c.name, argv, {}, launch, port)
        for p in gateways.values():
            p.wait(start_timeout_s)
        yield {c.name: (gateways[c.name] if c.via_gateway else servers[c.server]).url for c in contenders}
    finally:
        for p in [*gateways.values(), *servers.values()]:
            p.stop()
