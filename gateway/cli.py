"""The `flowprefill` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint dir (default: the embedded model)")
    p.add_argument("--policy", default="flowprefill",
                   help="prefill scheduling policy: flowprefill | fcfs | chunked:N[:fcfs] | edf | priority")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "sdpa", "flashinfer"])
    p.add_argument("--row-kernels", default=d.row_kernels, choices=["auto", "torch", "flashinfer"],
                   help="RMSNorm, SiLU-and-mul and RoPE: FlashInfer's fused kernels (auto: on CUDA when they load)")
    p.add_argument("--kv-capacity-tokens", type=int, default=d.kv_capacity_tokens)
    p.add_argument("--kv-block-size", type=int, default=d.kv_block_size)
    p.add_argument("--kv-reservation", default=d.kv_reservation, choices=["grow", "full"],
                   help="grow: an answer's KV as it grows, evicting (and later recomputing) answers when it "
                        "runs out; full: prompt + max_tokens up front, never evicting (default grow)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens)
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="queue bound: past it new requests get 503 (every class)")
    p.add_argument("--step-budget-ms", type=float, default=d.step_budget_ms,
                   help="longest predicted prefill step: bounds the preemption stop latency")
    p.add_argument("--cuda-graph-tokens", type=int, default=d.cuda_graph_tokens,
                   help="CUDA only: prefills of up to this many tokens replay CUDA graphs (0 = off)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=d.prefix_caching,
                   help="reuse the KV of prompt prefixes other requests computed, by KV block (default on)")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                   help="serve chat requests with tools (tool_choice auto), reading the model's calls in this "
                        "format: hermes (Qwen2.5, Hermes, the embedded model's template), llama3_json (Llama 3.1)")
    p.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                   help="a reasoning model's: its <think> reasoning comes back apart from the content "
                        "(reasoning_content), and a structured output applies after it")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _run_worker(args: argparse.Namespace) -> int:
    import uvicorn
    from rich.console import Console

    from engine.engine import Engine
    from engine.worker import create_worker_app
    from telemetry.tracing import setup_tracing

    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                       attention_backend=args.attention_backend, row_kernels=args.row_kernels,
                       kv_capacity_tokens=args.kv_capacity_tokens,
                       kv_block_size=args.kv_block_size, kv_reservation=args.kv_reservation,
                       max_batch_tokens=args.max_batch_tokens,
                       max_waiting=args.max_waiting,
                       step_budget_ms=args.step_budget_ms, cuda_graph_tokens=args.cuda_graph_tokens,
                       prefix_caching=args.prefix_caching, num_threads=args.threads)
    console = Console(stderr=True)
    with console.status("loading model and profiling operators…"):
        engine = Engine(cfg, policy=args.policy).start()
    name = engine.model.cfg.name
    app = create_worker_app(engine, name, tracing=setup_tracing("flowprefill-worker"), role=args.role,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    url = f"http://{args.host}:{args.port}"
    console.print(f"[bold green]FlowPrefill[/] {args.role} worker serving [bold]{name}[/] (policy {args.policy}, "
                  f"{engine.model.backend.name} attention) at [link={url}/v1]{url}/v1[/]")
    print(url, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, proxy_headers=False)
    return 0


def _worker_argv(args: argparse.Namespace, port: int, threads: int | None, role: str) -> list[str]:
    argv = [sys.executable, "-m", "gateway.cli", "worker", "--role", role, "--host", "127.0.0.1",
            "--port", str(port), "--policy", args.policy, "--device", args.device, "--dtype", args.dtype,
            "--attention-backend", args.attention_backend, "--row-kernels", args.row_kernels,
            "--kv-capacity-tokens", str(args.kv_capacity_tokens),
            "--kv-block-size", str(args.kv_block_size), "--kv-reservation", args.kv_reservation,
            "--max-batch-tokens", str(args.max_batch_tokens),
            "--max-waiting", str(args.max_waiting),
            "--step-budget-ms", str(args.step_budget_ms), "--cuda-graph-tokens", str(args.cuda_graph_tokens),
            "--prefix-caching" if args.prefix_caching else "--no-prefix-caching"]
    if args.model:
        argv += ["--model", args.model]
    if args.tool_call_parser:
        argv += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        argv += ["--reasoning-parser", args.reasoning_parser]
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def _exit_on_sigterm() -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown; exit through Python instead, so
    `finally` blocks (stopping child workers) run."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def _run_serve(args: argparse.Namespace) -> int:
    """Gateway in this process, engine workers as child processes on the next ports."""
    import os
    import subprocess

    from rich.console import Console

    from gateway.processes import wait_healthy

    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    if args.disaggregate and args.workers < 2:
        raise SystemExit("--disaggregate needs --workers 2 or more (prefill and decode workers)")
    _exit_on_sigterm()
    console = Console(stderr=True)
    # One core stays with the gateway (and the engine's own Python threads): on a 2-core host one torch
    # thread per worker gave far more goodput than two (docs/benchmarks.md, ideal-bound runs).
    threads = args.threads or max(1, ((os.cpu_count() or 1) - 1) // args.workers)
    ports = [args.port + 1 + i for i in range(args.workers)]
    n_prefill = args.workers // 2 if args.disaggregate else 0
    roles = ["prefill"] * n_prefill + ["decode" if args.disaggregate else "colocated"] * (args.workers - n_prefill)
    children = [subprocess.Popen(_worker_argv(args, p, threads, role)) for p, role in zip(ports, roles, strict=True)]
    try:
        with console.status(f"starting {args.workers} engine worker(s)…"):
            for child, port in zip(children, ports, strict=True):
                try:
                    wait_healthy(f"http://127.0.0.1:{port}", child)
                except (RuntimeError, TimeoutError) as exc:
                    raise SystemExit(f"engine worker on port {port}: {exc}") from None
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        args.prefill_urls, args.workers_urls = urls[:n_prefill] or None, urls[n_prefill:]
        return _run_gateway(args, console)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def _run_gateway(args: argparse.Namespace, console: object = None) -> int:
    import msgspec
    import uvicorn
    from rich.console import Console

    from gateway.app import create_gateway_app
    from gateway.config import GatewayConfig
    from telemetry.tracing import setup_tracing

    console = console or Console(stderr=True)
    cfg = GatewayConfig.load(args.config, args.workers_urls, getattr(args, "prefill_urls", None))
    overrides = {k: v for k, v in (("kind", getattr(args, "upstream", None)),
                                   ("max_concurrency", getattr(args, "max_concurrency", None))) if v}
    if overrides:
        cfg.upstream = msgspec.structs.replace(cfg.upstream, **overrides)
        cfg.check()
    app = create_gateway_app(cfg, tracing=setup_tracing("flowprefill-gateway"))
    url = f"http://{args.host}:{args.port}"
    route = (f"prefill {', '.join(cfg.prefill_workers)} → decode {', '.join(cfg.workers)}" if cfg.prefill_workers
             else ", ".join(cfg.workers))
    console.print(f"[bold green]FlowPrefill[/] gateway at [link={url}/v1]{url}/v1[/] → {route}")  # type: ignore[attr-defined]
    print(url, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, proxy_headers=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowprefill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="gateway + engine worker(s) on this machine (embedded model by default)")
    _engine_args(serve)
    serve.add_argument("--workers", type=int, default=1, help="engine worker processes (ports after --port)")
    serve.add_argument("--config", default=None, help="gateway TOML: SLO classes, API keys, rules")
    serve.add_argument("--disaggregate", action="store_true",
                       help="prefill/decode disaggregation: the first half of the workers prefill, the rest decode")
    gateway = sub.add_parser("gateway", help="the SLO gateway alone, in front of running workers")
    gateway.add_argument("--workers", dest="workers_urls", required=True, type=lambda s: s.split(","),
                         help="comma-separated worker base URLs (flowprefill workers or any OpenAI server)")
    gateway.add_argument("--config", default=None, help="gateway TOML: SLO classes, API keys, rules")
    gateway.add_argument("--prefill-workers", dest="prefill_urls", default=None, type=lambda s: s.split(","),
                         help="comma-separated prefill worker URLs: disaggregated, --workers then decode")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--upstream", choices=["flowprefill", "openai"], default=None,
                         help="what the workers are (overrides the config's [upstream] kind): openai = plain "
                              "OpenAI-compatible servers (vLLM, SGLang) behind an EDF queue at the gateway")
    gateway.add_argument("--max-concurrency", type=int, default=None,
                         help="openai upstreams: requests in flight per server (overrides the config)")
    worker = sub.add_parser("worker", help="run one engine worker (OpenAI API + /load, /health, /metrics)")
    _engine_args(worker)
    worker.add_argument("--role", choices=["colocated", "prefill", "decode"], default="colocated",
                        help="colocated: prefill and decode; prefill or decode: one half of PD disaggregation")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bench_sub.add_parser("prefill", help="prefill throughput, checkpoint overhead, preemption stop latency",
                         add_help=False)
    bench_sub.add_parser("goodput", help="max goodput per policy vs rate and SLO scale (real engine or sim)",
                         add_help=False)
    bench_sub.add_parser("gateway", help="latency the gateway adds and its requests/s on one core",
                         add_help=False)
    bench_sub.add_parser("prefix", help="prefix caching on a multi-turn chat workload: TTFT per turn, on vs off",
                         add_help=False)
    bench_sub.add_parser("kv", help="KV taken as answers grow vs reserved up front, on chat requests of a trace",
                         add_help=False)
    bench_sub.add_parser("peer", help="FlowPrefill next to vLLM / SGLang on this machine: goodput sweep or raw TTFT",
                         add_help=False)
    sub.add_parser("loadtest", help="a Locust profile, headless, against a gateway: per-class goodput report",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll is noise
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "loadtest":
        from loadtest import run

        return run.main(rest)
    if args.command == "bench":
        if args.bench == "goodput":
            from loadtest import goodput

            return goodput.main(rest)
        if args.bench == "gateway":
            from gateway import bench

            return bench.main(rest)
        if args.bench == "prefix":
            from engine.bench import prefix_cache

            return prefix_cache.main(rest)
        if args.bench == "peer":
            from loadtest.peer import cli as peer

            return peer.main(rest)
        if args.bench == "kv":
            from engine.bench import kv_growth

            return kv_growth.main(rest)
        from engine.bench import prefill

        return prefill.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "gateway":
        return _run_gateway(args)
    return _run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
