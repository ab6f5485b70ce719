"""The console that benchmarks and load tests print their result tables on."""

from __future__ import annotations

import os

from rich.console import Console

# Off a terminal (a pipe, a log file, CI) rich would take 80 columns and cut or fold every wider
# table; there a line may be as long as its table (the widest, `loadtest`'s side-by-side of policies
# and rates, is some 150 columns).
UNBOUNDED_WIDTH = 1000


def results_console(stderr: bool = False) -> Console:
    """A terminal's own width; elsewhere (unless $COLUMNS says otherwise) wide enough that no table is cut."""
    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=UNBOUNDED_WIDTH)
