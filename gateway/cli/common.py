"""What every `flowprefill` subcommand shares: its argument parser (defaults shown, one-line errors),
the error a user's mistake raises, the address options, and serving an ASGI app on a socket bound beforehand."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from engine.protocol.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain


class CommandLineError(Exception):
    """A mistake the user must fix (a port in use, a missing model directory, a bad config file):
    `flowprefill` prints it as one line on stderr, no traceback, and exits with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers of at least 1, a `k` suffix for 1024s ('512,2k,8K'
    -> (512, 2048, 8192))."""
    values = []
    for item in (v.strip().lower() for v in text.split(",")):
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        try:
            values.append(int(item.removesuffix("k")) * scale)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected counts like 512,2k,8k, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected counts of at least 1, got {text!r}")
    return tuple(values)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, unless the help says it or there is none to say (an
    unset value, an off flag); descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action) or text


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr (exit 2), not the usage block and the error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hint = f" (see {self.prog} --help)" if message.startswith("the following arguments are required") else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def port_number(value: str) -> int:
    port = int(value)
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1 to {MAX_PORT})")
    return port


MAX_PORT = 65535
port_number.__name__ = "port"  # argparse names the type in its error: "invalid port value: 'x'"


def add_address(parser: argparse.ArgumentParser, host_help: str = "address to listen on",
                port_help: str = "port to listen on", port: int = 8000) -> None:
    parser.add_argument("--host", default="127.0.0.1", help=host_help)
    parser.add_argument("--port", type=port_number, default=port, metavar="PORT", help=port_help)


def missing_extra(extra: str) -> list[str]:
    """The packages of the install's `extra` (pyproject.toml's optional dependencies) not installed:
    a base install is the gateway alone, and `serve` without the engine would fail deep in an import."""
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        wanted = [r for r in requires("flowprefill") or [] if f'extra == "{extra}"' in r]
    except PackageNotFoundError:  # run from a source tree that is not installed: nothing to compare
        return []
    missing = []
    for requirement in wanted:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group()  # type: ignore[union-attr]
        try:
            version(name)
        except PackageNotFoundError:
            missing.append(name)
    return missing


def require_extras(extras: tuple[str, ...]) -> None:
    """CommandLineError naming the extra to install when a command needs one that is not there."""
    for extra in extras:
        if missing := missing_extra(extra):
            hint = " (install torch first: the CPU or the CUDA build, docs/deploy.md)" if "torch" in missing else ""
            raise CommandLineError(f"this command needs the {extra} extra, whose {', '.join(missing)} "
                                   f"{'is' if len(missing) == 1 else 'are'} not installed: "
                                   f"pip install 'flowprefill[{extra}]'{hint}")


def bind(host: str, port: int, what: str) -> socket.socket:
    """The listening socket of `what` (e.g. "the gateway"), bound before anything is loaded or announced."""
    from gateway.processes import PortInUse, bind

    try:
        return bind(host, port)
    except PortInUse as exc:
        raise CommandLineError(f"{what} on {host}:{port}: {exc.strerror}") from None


def add_shutdown_timeout(parser: argparse.ArgumentParser) -> None:
    def seconds(value: str) -> float:
        if not float(value) >= 0:
            raise argparse.ArgumentTypeError(f"{value} is not a number of seconds >= 0")
        return float(value)

    parser.add_argument("--shutdown-timeout", type=seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGTERM or a first Ctrl-C: stop taking requests (/health answers 503), let those "
                             "in flight finish for up to this long, end the rest with an error (503) and exit 0; a "
                             "second Ctrl-C or SIGTERM exits at once (the default fits Kubernetes' 30 s grace period)")


def serve_app(app: Any, sock: socket.socket, drain: Drain | None = None, shutdown_timeout_s: float = 0.0,
              at_once: Callable[[], Any] | None = None) -> None:
    """uvicorn on `sock` until SIGINT or SIGTERM, then the graceful shutdown `drain` describes (see
    add_shutdown_timeout). A second signal exits at once (code 130), after `at_once` (serve's workers)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's, but the first signal begins the drain, and uvicorn does not raise it again once
        stopped (the drain's end is no error: exit 0)."""

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:  # asyncio's teardown would cancel each request's task, each a traceback
                if at_once is not None:
                    at_once()
                sys.stderr.flush()
                os._exit(130)
            self.should_exit = True
            self.loop.call_soon_threadsafe(drain.begin, shutdown_timeout_s)

    drain = drain or Drain()
    # uvicorn's own limit is a backstop (it cancels what is left without a word): the drain answers first
    config = uvicorn.Config(app, log_level="warning", access_log=False, proxy_headers=False,
                            timeout_graceful_shutdown=int(shutdown_timeout_s) + 2)
    Server(config).run(sockets=[sock])


def exit_on_sigterm() -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown; exit through Python instead, so
    `finally` blocks (stopping child workers) run."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
