"""Run the SLO gateway alone, in front of engine workers that are already running (on this machine
or on others), or in front of plain OpenAI-compatible servers (vLLM, SGLang) with --upstream openai.
It classifies each request into an SLO class, stamps its deadline and routes it to the least loaded
healthy worker; /health answers 503 while no worker a request needs is healthy."""

from __future__ import annotations

import argparse
import socket
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.cli.common import CommandLineError, add_address, add_shutdown_timeout, bind, serve_app
from gateway.config import GatewayConfig, Upstream

if TYPE_CHECKING:
    from rich.console import Console


def worker_urls(value: str) -> list[str]:
    """A --workers value: comma-separated URLs and dns:NAME:PORT sources."""
    return [u for u in value.split(",") if u]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", dest="workers_urls", required=True, type=worker_urls, metavar="URLS",
                        help="comma-separated worker base URLs (flowprefill workers or any OpenAI server), or "
                             "dns:NAME:PORT for every address of NAME (a headless Service), looked up again every "
                             "discovery.interval_s of the --config")
    parser.add_argument("--prefill-workers", dest="prefill_urls", default=None, type=worker_urls, metavar="URLS",
                        help="comma-separated prefill worker URLs (or dns: sources): disaggregated, --workers then "
                             "decode")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="gateway TOML: SLO classes, API keys, rules, [upstream]")
    add_address(parser)
    add_shutdown_timeout(parser)
    upstream = Upstream()
    parser.add_argument("--upstream", choices=typing.get_args(typing.get_type_hints(Upstream)["kind"]),
                        default=None,
                        help="what the workers are (overrides the config's [upstream] kind; default "
                             f"{upstream.kind}): openai = plain OpenAI-compatible servers (vLLM, SGLang) behind "
                             "a slack-ordered queue at the gateway")
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="openai upstreams: requests in flight per server (overrides the config; default "
                             f"{upstream.max_concurrency})")
    parser.add_argument("--max-tokens-in-flight", type=int, default=None, metavar="N",
                        help="openai upstreams: prompt tokens in prefill per server, e.g. the server's step "
                             "budget, vLLM's max_num_batched_tokens (overrides the config; default "
                             f"{upstream.max_tokens_in_flight}: count requests only)")
    parser.add_argument("--reserve-tokens", type=int, default=None, metavar="N",
                        help="openai upstreams with a token budget: a prompt longer than the budget less N counts "
                             "as the budget less N, leaving N tokens to shorter ones (overrides the config; default "
                             "-1: a quarter of the budget; 0: none)")
    parser.add_argument("--slack", choices=typing.get_args(typing.get_type_hints(Upstream)["slack"]), default=None,
                        help="openai upstreams: waiters go by their deadline less the time to first token seen for "
                             "prompts of their size, and turn late once that has passed (observed), or by their "
                             f"deadline alone (deadline) (overrides the config; default {upstream.slack})")
    parser.add_argument("--backfill", choices=("on", "off"), default=None,
                        help="openai upstreams with a token budget: a streamed waiter may take budget that an "
                             "earlier, longer one cannot use yet, if it is expected back before that one must "
                             "start (on), "
                             f"or waiters go in strict order (off) (overrides the config; default "
                             f"{'on' if upstream.backfill else 'off'})")


def load_config(path: str | None, workers: list[str], prefill_workers: list[str] | None = None,
                **upstream: Any) -> GatewayConfig:
    """The gateway's configuration: the TOML file's (if any), these workers, `upstream` overrides
    that are set. A file that is missing or wrong is the user's to fix: CommandLineError."""
    import msgspec

    try:
        cfg = GatewayConfig.load(path, workers, prefill_workers)
        if overrides := {k: v for k, v in upstream.items() if v is not None}:
            cfg.upstream = msgspec.structs.replace(cfg.upstream, **overrides)
            cfg.check()
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        message = exc.strerror.lower() if isinstance(exc, OSError) and exc.strerror else str(exc)
        message = message.removeprefix(f"{path}: ")  # GatewayConfig.load names the file in some
        raise CommandLineError(f"--config {path}: {message}" if path else message) from None
    return cfg


def serve_gateway(cfg: GatewayConfig, sock: socket.socket, url: str, shutdown_timeout_s: float,
                  console: Console | None = None, at_once: Callable[[], Any] | None = None) -> None:
    """Announce the gateway at `url` and serve on `sock` until stopped (with a graceful shutdown of up
    to `shutdown_timeout_s`; `at_once`: what a second signal also stops, as it exits)."""
    from rich.console import Console

    from engine.protocol.drain import Drain
    from gateway.app import create_gateway_app
    from telemetry.tracing import setup_tracing

    console = console or Console(stderr=True)
    drain = Drain()
    app = create_gateway_app(cfg, tracing=setup_tracing("flowprefill-gateway"), drain=drain)
    route = (f"prefill {', '.join(cfg.prefill_workers)} → decode {', '.join(cfg.workers)}" if cfg.prefill_workers
             else ", ".join(cfg.workers))
    console.print(f"[bold green]FlowPrefill[/] gateway at [link={url}/v1]{url}/v1[/] → {route}", soft_wrap=True)
    print(url, flush=True)
    serve_app(app, sock, drain, shutdown_timeout_s, at_once)


def run(args: argparse.Namespace) -> int:
    if not args.workers_urls:
        raise CommandLineError("--workers names no URL")
    cfg = load_config(args.config, args.workers_urls, args.prefill_urls, kind=args.upstream,
                      max_concurrency=args.max_concurrency,
                      max_tokens_in_flight=args.max_tokens_in_flight, reserve_tokens=args.reserve_tokens,
                      slack=args.slack,
                      backfill=None if args.backfill is None else args.backfill == "on")
    sock = bind(args.host, args.port, "the gateway")
    serve_gateway(cfg, sock, f"http://{args.host}:{args.port}", args.shutdown_timeout)
    return 0
