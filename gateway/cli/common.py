"""What every `flowprefill` subcommand shares: its argument parser (defaults shown, one-line errors),
the error a user's mistake raises, and serving an ASGI app on a socket bound beforehand."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any, NoReturn


class CommandLineError(Exception):
    """A mistake the user must fix (a port in use, a missing model directory, a bad config file):
    `flowprefill` prints it as one line on stderr, no traceback, and exits with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


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


def bind(host: str, port: int, what: str) -> socket.socket:
    """The listening socket of `what` (e.g. "the gateway"), bound before anything is loaded or announced."""
    from gateway.processes import PortInUse, bind

    try:
        return bind(host, port)
    except PortInUse as exc:
        raise CommandLineError(f"{what} on {host}:{port}: {exc.strerror}") from None


def serve_app(app: Any, sock: socket.socket) -> None:
    """uvicorn on `sock` until SIGINT or SIGTERM."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, proxy_headers=False)
    uvicorn.Server(config).run(sockets=[sock])


def exit_on_sigterm() -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown; exit through Python instead, so
    `finally` blocks (stopping child workers) run."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
