"""Run one engine worker: the model behind the OpenAI API (/v1/completions, /v1/chat/completions,
/v1/models), plus /load (what the gateway routes on), /health and /metrics. Its port is taken before
the model loads; a checkpoint or setting it cannot run stops it with one line saying why."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gateway.cli.common import CommandLineError, add_address, add_shutdown_timeout, bind, serve_app
from gateway.cli.options import add_engine_options, add_server_options, check_model, engine_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.protocol.worker import ROLES

    add_address(parser)
    add_shutdown_timeout(parser)
    parser.add_argument("--role", choices=ROLES, default="colocated",
                        help="colocated: prefill and decode; prefill or decode: one half of PD disaggregation")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="gateway TOML whose SLO classes this worker serves: their targets and what becomes "
                             "of their late requests (serve passes its own --config on)")
    add_server_options(parser)
    add_engine_options(parser, served=True)


def check_device(name: str) -> None:
    """--device names a device this machine has (torch's own failure is an AssertionError, deep in loading)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise CommandLineError(f"--device {name}: {exc}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise CommandLineError(f"--device {name}: this machine has {count} CUDA device(s) "
                                   f"(torch {torch.__version__})")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from engine.core.engine import Engine
    from engine.protocol.drain import Drain
    from engine.serving.worker import create_worker_app
    from gateway.cli.gateway import load_config
    from telemetry.tracing import setup_tracing

    check_model(args.model)
    classes = load_config(args.config, []).classes if args.config else None
    sock = bind(args.host, args.port, "the worker")
    check_device(args.device)
    # The engine thread takes the GIL back after every operator; while the HTTP thread runs Python it
    # waits up to the switch interval (5 ms by default) each time. With a Python thread busy beside it an
    # 8K prefill took 11 s instead of 1.4 (2.8 s at 1 ms, 1.9 s at 0.2 ms).
    sys.setswitchinterval(0.0002)
    console = Console(stderr=True)
    try:
        with console.status("loading model and profiling operators…"):
            engine = Engine(engine_config(args), policy=args.policy).start()
        name = engine.model.cfg.name
        drain = Drain()
        app = create_worker_app(engine, name, classes, tracing=setup_tracing("flowprefill-worker"), role=args.role,
                                tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                                drain=drain)
    except (OSError, ValueError) as exc:  # the checkpoint or a setting: the loader's messages (docs/engine.md)
        raise CommandLineError(str(exc)) from None
    url = f"http://{args.host}:{args.port}"
    console.print(f"[bold green]FlowPrefill[/] {args.role} worker serving [bold]{name}[/] (policy {args.policy}, "
                  f"{engine.model.backend.name} attention) at [link={url}/v1]{url}/v1[/]", soft_wrap=True)
    print(url, flush=True)
    serve_app(app, sock, drain, args.shutdown_timeout)
    # Everything is stopped and flushed (the app's shutdown ran: engine, tracing). The interpreter's own
    # teardown (torch, its thread pools) took another second, counted against a pod's grace period.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
