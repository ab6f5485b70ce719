"""`flowprefill bench decode`: one decode step (every answer's next token) by how many answers decode at
once and how long their contexts are, per attention backend, on this machine.

The CPU backend reads each answer's keys and values where they lie in the paged KV cache, every answer
in one call (engine/attention/cpu_decode.cpp); SDPA gathers each answer's blocks into contiguous K and
V first and calls torch's attention per answer. Both run the same model (its projections, MLP and head
alike), so their difference is the attention's. Per size, the backends alternate step by step; each
figure is the median step. Every answer's context is a copy of one prompt's KV, prefilled first.

Writes decode.json and decode.png; prints the table. Exits 1 when the backends' logits of a step differ
by more than the dtype's rounding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine.bench.contenders import OurPrefill
from engine.bench.report import command, save_figure
from engine.core.config import TINY_MODEL, EngineConfig
from engine.core.kv_cache import KVCache
from engine.model import LlamaModel, load_model
from engine.model.calibration import load_cost
from gateway.cli.common import Parser, counts
from loadtest.machine import machine_info

BLOCK = 16  # KV block size: an answer's blocks lie scattered over the cache, as a running engine's do


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return value


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names or set(names) - {"cpu", "sdpa", "flashinfer"} or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct names of cpu, sdpa, flashinfer")
    return names


def _refuse(message: str) -> NoReturn:
    print(f"flowprefill bench decode: {message}", file=sys.stderr)
    raise SystemExit(2)


def _tables(answers: int, context: int) -> list[list[int]]:
    """Block tables of `answers` answers of `context` tokens, their blocks interleaved across the cache."""
    blocks = -(-(context + 1) // BLOCK)
    return [list(range(a, answers * blocks, answers)) for a in range(answers)]


def _step(model: LlamaModel, kv: KVCache, tables: list[list[int]], context: int) -> tuple[float, torch.Tensor]:
    """One decode step at position `context` of every answer: its seconds and logits."""
    n = len(tables)
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = model.decode([7] * n, [context] * n, tables, kv)
    return time.perf_counter() - t0, logits


def _load(args: argparse.Namespace, console: Console) -> dict[str, LlamaModel]:
    models = {}
    for backend in args.backends:
        console.print(f"loading {args.model} ({args.dtype}) with the {backend} attention backend")
        try:
            model, _ = load_model(EngineConfig(model=args.model, dtype=args.dtype, attention_backend=backend))
        except (ValueError, FileNotFoundError) as exc:  # a backend or model this machine cannot run
            _refuse(str(exc))
        if model.backend.name != backend:
            _refuse(f"the {backend} attention backend does not run here ({model.backend.name} would)")
        models[backend] = model
    return models


def _prefilled(model: LlamaModel, args: argparse.Namespace, console: Console) -> tuple[KVCache, list[int]]:
    """A cache for every answer of every size, and the blocks after theirs holding the KV of a prompt of
    the longest context, prefilled by `model`: each size's answers decode on copies of it (a step of
    random keys and values runs as fast, but its logits say nothing of whether the backends agree)."""
    context = max(args.contexts)
    source_blocks = -(-(context + 1) // BLOCK)
    first_source = max(args.answers) * source_blocks
    kv = KVCache(model.cfg, BLOCK, (first_source + source_blocks) * BLOCK, getattr(torch, args.dtype), model.device)
    source = list(range(first_source, first_source + source_blocks))
    console.print(f"prefilling a {context:,}-token prompt for the answers' KV")
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(args.seed))
    OurPrefill(model, kv, load_cost(model, record=False), None, check=False)(prompt.tolist(), source)
    return kv, source


def _copy_into(kv: KVCache, source: list[int], tables: list[list[int]]) -> None:
    dst = torch.tensor([b for t in tables for b in t])
    src = torch.tensor([source[i] for t in tables for i in range(len(t))])
    for layer in range(len(kv.k)):
        kv.k[layer][dst] = kv.k[layer][src]
        kv.v[layer][dst] = kv.v[layer][src]


def _cell(models: dict[str, LlamaModel], kv: KVCache, answers: int, context: int, repeats: int) -> dict[str, Any]:
    """Per backend, `repeats` steps alternating with the others' (after a round that warms up and whose
    logits are compared: a benchmark of backends that answer differently is void)."""
    tables = _tables(answers, context)
    times: dict[str, list[float]] = {b: [] for b in models}
    logits: dict[str, torch.Tensor] = {}
    order = list(models)
    for rep in range(repeats + 1):
        for backend in (order if rep % 2 == 0 else order[::-1]):
            t, out = _step(models[backend], kv, tables, context)
            if rep:
                times[backend].append(t)
            else:
                logits[backend] = out.float()
    first = logits[order[0]]
    return {"answers": answers, "context": context, "step_s": times,
            "median_ms": {b: 1000 * statistics.median(ts) for b, ts in times.items()},
            "max_relative_difference": max(float((x - first).abs().max() / first.abs().max()) for x in logits.values())}


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    models = _load(args, console)
    first = models[args.backends[0]]
    kv, source = _prefilled(first, args, console)  # one cache: every backend reads the same keys and values
    per: dict[str, dict[str, Any]] = {}
    cells = [(a, c) for a in args.answers for c in args.contexts]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decode steps", total=len(cells))
        for answers, context in cells:
            _copy_into(kv, source, _tables(answers, context))
            per[f"{answers}x{context}"] = _cell(models, kv, answers, context, args.repeats)
            progress.advance(task)
    return {"command": " ".join(["flowprefill bench decode", *args.argv]), "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(), "model": first.cfg.name,
            "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "argv": None, "block_size": BLOCK},
            "torch_threads": torch.get_num_threads(), "cells": per}


def table(results: dict[str, Any]) -> Table:
    backends = results["config"]["backends"]
    t = Table(title=f"Decode step, {results['model']} {results['config']['dtype']}, "
                    f"{results['torch_threads']} thread(s): median ms per step (tokens/s)")
    for col in ("answers", "context", *backends, *([f"{backends[0]} ÷ {backends[1]}"] if len(backends) == 2 else [])):
        t.add_column(col, justify="right")
    for cell in results["cells"].values():
        ms = cell["median_ms"]
        row = [f"{ms[b]:.2f} ({1000 * cell['answers'] / ms[b]:,.0f})" for b in backends]
        ratio = [f"{ms[backends[0]] / ms[backends[1]]:.2f}"] if len(backends) == 2 else []
        t.add_row(str(cell["answers"]), f"{cell['context']:,}", *row, *ratio)
    return t


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    fig, axes = plt.subplots(1, len(cfg["answers"]), figsize=(4.5 * len(cfg["answers"]), 4), squeeze=False)
    for ax, answers in zip(axes[0], cfg["answers"], strict=True):
        cells = [c for c in results["cells"].values() if c["answers"] == answers]
        for backend in cfg["backends"]:
            ax.plot([c["context"] for c in cells], [c["median_ms"][backend] for c in cells], marker="o",
                    label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context per answer (tokens)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"{answers} answer{'s' if answers > 1 else ''} at once")
        ax.legend(fontsize=8)
    save_figure(fig, results, path)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench decode", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--model", default=TINY_MODEL, help="tiny (default), smollm2, a checkpoint directory or a .gguf")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backends", type=_backends, default=["cpu", "sdpa"],
                   help="attention backends, comma-separated: cpu, sdpa, flashinfer (default: cpu,sdpa)")
    p.add_argument("--answers", type=counts, default=[1, 8, 32], help="answers decoding at once (default: 1,8,32)")
    p.add_argument("--contexts", type=counts, default=[128, 1024, 4096],
                   help="tokens of context per answer (default: 128,1024,4096)")
    p.add_argument("--repeats", type=_positive, default=7, help="steps timed per backend and size (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p


def agree(results: dict[str, Any]) -> bool:
    """Whether every backend's logits were the first's, to the dtype's rounding."""
    tol = 1e-4 if results["config"]["dtype"] == "float32" else 5e-2
    return all(c["max_relative_difference"] < tol for c in results["cells"].values())


main = command("decode", build_parser, run, table, plot, agree)


if __name__ == "__main__":
    raise SystemExit(main())
