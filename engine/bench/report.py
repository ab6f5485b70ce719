"""The command of a benchmark that measures, prints a table, writes its JSON and draws its plot."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from gateway.cli.console import results_console

Results = dict[str, Any]


def command(name: str, build_parser: Callable[[], argparse.ArgumentParser],
            run: Callable[[argparse.Namespace, Console], Results], table: Callable[[Results], Table],
            plot: Callable[[Results, Any], None], ok: Callable[[Results], bool] = lambda _: True
            ) -> Callable[[list[str] | None], int]:
    """`main(argv)`: parse (the parser has --threads and --out), run, print the table, write
    `<out>/<name>.json` and `<out>/<name>.png`; exit status 1 when `ok` says the results are wrong."""

    def main(argv: list[str] | None = None) -> int:
        args = build_parser().parse_args(argv)
        args.argv = list(argv or [])
        if args.threads:
            torch.set_num_threads(args.threads)
        console = results_console()
        results = run(args, console)
        console.print(table(results))
        args.out.mkdir(parents=True, exist_ok=True)
        results["config"]["out"] = str(args.out)
        (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
        plot(results, args.out / f"{name}.png")
        console.print(f"wrote {args.out / f'{name}.json'} and {args.out / f'{name}.png'}")
        return 0 if ok(results) else 1

    return main


def save_figure(fig: Any, results: Results, path: Any) -> None:
    """Title a benchmark's figure with the command that made it, and write it."""
    import matplotlib.pyplot as plt

    fig.suptitle(results["command"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
