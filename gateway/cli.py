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
    p.add_argument("--kv-capacity-tokens", type=int, default=d.kv_capacity_tokens)
    p.add_argument("--kv-block-size", type=int, default=d.kv_block_size)
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens)
    p.add_argument("--step-budget-ms", type=float, default=d.step_budget_ms,
                   help="longest predicted prefill step: bounds the preemption stop latency")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _run_worker(args: argparse.Namespace) -> int:
    import uvicorn
    from rich.console import Console

    from engine.engine import Engine
    from engine.worker import create_worker_app

    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                       attention_backend=args.attention_backend, kv_capacity_tokens=args.kv_capacity_tokens,
                       kv_block_size=args.kv_block_size, max_batch_tokens=args.max_batch_tokens,
                       step_budget_ms=args.step_budget_ms, num_threads=args.threads)
    console = Console(stderr=True)
    with console.status("loading model and profiling operators…"):
        engine = Engine(cfg, policy=args.policy).start()
    name = engine.model.cfg.name
    app = create_worker_app(engine, name)
    url = f"http://{args.host}:{args.port}"
    console.print(f"[bold green]FlowPrefill[/] serving [bold]{name}[/] (policy {args.policy}, "
                  f"{engine.model.backend.name} attention) at [link={url}/v1]{url}/v1[/]")
    print(url, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="flowprefill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API on this machine (embedded model by default)")
    _engine_args(serve)
    worker = sub.add_parser("worker", help="run one engine worker (OpenAI API + /load, /health, /metrics)")
    _engine_args(worker)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bench_sub.add_parser("prefill", help="prefill throughput, checkpoint overhead, preemption stop latency",
                         add_help=False)
    bench_sub.add_parser("goodput", help="max goodput per policy vs rate and SLO scale (real engine or sim)",
                         add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if args.bench == "goodput":
            from loadtest import goodput

            return goodput.main(rest)
        from engine.bench import prefill

        return prefill.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return _run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
