"""What `flowprefill bench peer`'s options set up for every contender: the cores and threads they run on
(`placement`) and the model they all load (`model_dir`: a checkpoint directory, or the embedded model
written as one)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from loadtest.machine import cpu_count
from loadtest.peer.checkpoint import write_checkpoint
from loadtest.peer.servers import Placement, SpecError


def placement(args: argparse.Namespace, threads: int | None = None) -> Placement:
    threads = threads or args.threads
    if threads < 1:
        raise SpecError("--threads must be >= 1")
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(cpu_count()))
    if args.cores:
        try:
            cores = tuple(int(c) for c in args.cores.split(","))
        except ValueError:
            raise SpecError(f"--cores {args.cores!r}: expected comma-separated core numbers") from None
        if not set(cores) <= set(mine):
            raise SpecError(f"--cores {args.cores}: this process may run on cores {mine} only")
    else:
        cores = tuple(mine[-threads:])
    if len(cores) < threads:
        raise SpecError(f"{threads} threads need as many cores; {len(cores)} given ({list(cores)})")
    return Placement(cores, threads, args.device)


def model_dir(args: argparse.Namespace, console: Console) -> Path:
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SpecError(f"--model {args.model}: no config.json (a Hugging Face checkpoint directory)")
        return args.model
    path = args.out / "checkpoint"
    if not (path / "tokenizer.json").is_file():
        write_checkpoint(path)
        console.print(f"wrote the embedded model as a checkpoint (with a byte-level tokenizer) to {path}")
    return path
