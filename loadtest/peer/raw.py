"""The raw mode of `flowprefill bench peer`: one request alone, prompt by prompt length, dtype and
thread count, TTFT at the client, median of several with the contenders alternating; each as GFLOP/s
(the model's prefill FLOPs over the TTFT) beside the machine's matmul peak measured in the same run
on the same cores, and again with a busy process on a core the servers do not use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine.core.config import ModelConfig
from loadtest.flops import prefill_flops
from loadtest.machine import machine_info
from loadtest.peer.busy import BusyLoad
from loadtest.peer.client import PROMPT_VOCAB, Arrival, Target, model_name, replay
from loadtest.peer.servers import Contender, Launch, Placement, SpecError, fleet
from loadtest.peer.setup import model_dir, placement
from loadtest.peer.sweep import rotation
from loadtest.workload import synthesize_prompt


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise SpecError(f"{flag} {text!r}: expected integers >= 1")
    return values


def peak_gflops(dtype: str, where: Placement) -> float:
    """The matmul peak in a child pinned to the servers' cores, with their thread count."""
    done = subprocess.run([sys.executable, "-m", "loadtest.peer.peak", "--dtype", dtype, "--threads",
                           str(where.threads)], capture_output=True, text=True, preexec_fn=where.pin, check=True)
    return float(json.loads(done.stdout)["gflops"])


def ttft_s(target: Target, n: int, seed: str, timeout_s: float) -> float | str:
    """The TTFT of one request alone, or why it failed (its status and error)."""
    prompt = synthesize_prompt(n, PROMPT_VOCAB, seed=seed)
    # `standard`: a class that is never shed. As `batch` (sheddable), an 8K prompt whose warm-up ran slow
    # beside the busy process was refused (429 predicted_slo_miss) at every repeat: nothing was timed.
    rec = asyncio.run(replay(target, [Arrival(0, 0.0, "standard", n, prompt)], drain_s=timeout_s))[0]
    if rec.ok and rec.ttft_s is not None:
        return rec.ttft_s
    return f"HTTP {rec.status}: {rec.error}"


class RawRun:
    """One (dtype, threads) configuration: servers started, every prompt length timed."""

    def __init__(self, args: argparse.Namespace, chosen: list[Contender], cfg: ModelConfig, model: Path,
                 progress: Progress, task: Any) -> None:
        self.args, self.chosen, self.cfg, self.model = args, chosen, cfg, model
        self.progress, self.task = progress, task
        self.prompts = _ints(args.raw_prompts, "--raw-prompts")
        self.timeout_s = max(args.drain_s, 300.0)  # one 8K-token prefill may take tens of seconds
        self.all_cores = set(os.sched_getaffinity(0))

    def run(self, dtype: str, threads: int) -> list[dict[str, Any]]:
        os.sched_setaffinity(0, self.all_cores)  # the last configuration pinned this process elsewhere
        where = placement(self.args, threads)
        launch = Launch(self.model, dtype, where, {c.server.kind: getattr(self.args, f"{c.server.kind}_python")
                                                   for c in self.chosen if c.server.kind != "flowprefill"},
                        self.args.out / "logs", max_model_len=self.args.max_model_len)
        others = tuple(sorted(self.all_cores - set(where.cores)))
        if others and where.device == "cpu":
            os.sched_setaffinity(0, set(others))  # the client beside the servers, not on their cores
        rows = []
        with ExitStack() as stack:
            self.progress.update(self.task, description=f"{dtype}, {threads} thread(s): starting servers")
            urls = stack.enter_context(fleet(self.chosen, launch, self.args.start_timeout_s))
            targets = {c.name: Target(urls[c.name], model_name(urls[c.name])) for c in self.chosen}
            for busy in (False, True) if others and where.device == "cpu" else (False,):
                load = BusyLoad(others[:1], 1.0).start() if busy else None
                try:
                    peak = peak_gflops(dtype, where)
                    rows += [self.size(targets, dtype, where, n, peak, busy) for n in self.prompts]
                finally:
                    if load:
                        load.stop()
        return rows

    def size(self, targets: dict[str, Target], dtype: str, where: Placement, n: int, peak: float,
             busy: bool) -> dict[str, Any]:
        label = f"{dtype}, {where.threads} thread(s){', busy other core' if busy else ''}: {n} tokens"
        self.progress.update(self.task, description=label)
        names = list(targets)
        for name in names:  # one untimed request each at this size: allocations of its shapes
            ttft_s(targets[name], n, f"raw-warm-{n}", self.timeout_s)
        times: dict[str, list[float | str]] = {name: [] for name in names}
        for rep in range(self.args.raw_repeats):
            for name in rotation(names, rep):  # alternating: A B, B A, ...
                time.sleep(self.args.raw_settle_s)  # the last one's threads stop spinning on the shared cores
                times[name].append(ttft_s(targets[name], n, f"raw-{n}-{rep}", self.timeout_s))
        self.progress.advance(self.task)
        flops = prefill_flops(self.cfg, n)
        out = {}
        for name, ts in times.items():
            ok = [t for t in ts if not isinstance(t, str)]
            med = statistics.median(ok) if ok else None
            out[name] = {"ttft_ms": [None if isinstance(t, str) else round(t * 1000, 2) for t in ts],
                         "errors": sorted({t for t in ts if isinstance(t, str)}),
                         "median_ms": None if med is None else round(med * 1000, 2),
                         "gflops": None if med is None else round(flops / med / 1e9, 2),
                         "share_of_peak": None if med is None else round(flops / med / 1e9 / peak, 4)}
        return {"dtype": dtype, "threads": where.threads, "cores": list(where.cores), "busy_other_core": busy,
                "prompt_tokens": n, "prefill_gflop": round(flops / 1e9, 3), "peak_gflops": round(peak, 2),
                "contenders": out}


def run(args: argparse.Namespace, chosen: list[Contender], versions: dict[str, str | None], console: Console) -> int:
    dtypes = [d for d in args.raw_dtypes.split(",") if d]
    if any(d not in ("bfloat16", "float32") for d in dtypes) or not dtypes:
        raise SpecError(f"--raw-dtypes {args.raw_dtypes!r}: bfloat16 and/or float32")
    threads = _ints(args.raw_threads, "--raw-threads")
    for t in threads:
        placement(args, t)  # too many threads for the cores: said before anything starts
    model = model_dir(args, console)
    cfg = ModelConfig.from_dir(model)
    n_sizes = len(_ints(args.raw_prompts, "--raw-prompts"))
    rows: list[dict[str, Any]] = []
    with Progress(console=console) as progress:
        task = progress.add_task("raw", total=len(dtypes) * sum(2 if t < len(os.sched_getaffinity(0)) else 1
                                                                 for t in threads) * n_sizes)
        raw = RawRun(args, chosen, cfg, model, progress, task)
        for dtype in dtypes:
            for t in threads:
                rows += raw.run(dtype, t)
    doc = {"mode": "raw", "model": model.name, "checkpoint": str(model), "versions": versions,
           "contenders": [c.name for c in chosen], "repeats": args.raw_repeats, "rows": rows,
           "flops": "per layer 2*h*(q+2kv) + 2*q*h + 6*h*i per row, 4*heads*head_dim per causal query-key pair; "
                    "plus the last row's logits",
           "machine": machine_info() | {"loadavg_at_end": os.getloadavg()},
           "command": "flowprefill bench peer " + " ".join(args.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer-raw.json").write_text(json.dumps(doc, indent=1))
    plot(doc, args.out / "peer-raw.png")
    console.print(table(doc))
    console.print(f"wrote {args.out / 'peer-raw.json'} and {args.out / 'peer-raw.png'}")
    return 0


def table(doc: dict[str, Any]) -> Table:
    t = Table(title=f"one request alone: client TTFT, median of {doc['repeats']} (GFLOP/s, share of the matmul peak)")
    for col in ("dtype", "threads", "other core", "tokens", "peak GFLOP/s", *doc["contenders"]):
        t.add_column(col, justify="right")
    for r in doc["rows"]:
        cells = []
        for name in doc["contenders"]:
            c = r["contenders"][name]
            cells.append(f"failed ({'; '.join(c.get('errors', []))[:60]})" if c["median_ms"] is None else
                         f"{c['median_ms']:.0f} ms ({c['gflops']:.1f}, {c['share_of_peak']:.0%})")
        t.add_row(r["dtype"], str(r["threads"]), "busy" if r["busy_other_core"] else "idle", str(r["prompt_tokens"]),
                  f"{r['peak_gflops']:.0f}", *cells)
    return t


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(doc["rows"])), 4.5))
    width = 0.8 / max(1, len(doc["contenders"]))
    for i, name in enumerate(doc["contenders"]):
        cells = [r["contenders"][name] for r in doc["rows"]]
        xs = [k + i * width for k in range(len(cells))]
        shares = [(c["share_of_peak"] or 0) * 100 for c in cells]
        ax.bar(xs, shares, width, label=name)
        for x, share, c in zip(xs, shares, cells, strict=True):  # the TTFT each bar stands for
            if c["median_ms"] is not None:
                ax.text(x, share + 0.5, f"{c['median_ms']:.0f}", ha="center", va="bottom", fontsize=5.5)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(doc["rows"]))])
    ax.set_xticklabels([f"{r['prompt_tokens']}\n{short.get(r['dtype'], r['dtype'])} {r['threads']}t"
                        f"\n{'busy' if r['busy_other_core'] else ''}" for r in doc["rows"]], fontsize=7)
    ax.set_xlabel("prompt tokens, dtype, threads (busy: a busy process on the other core); "
                  "numbers on the bars: TTFT ms, median", fontsize=8)
    ax.set_ylabel("prefill GFLOP/s, % of the measured matmul peak")
    ax.set_title(f"one request alone on {doc['model']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
