"""`flowprefill bench prefix`: what prefix caching buys a multi-turn chat workload.

Conversations share a system prompt; each turn's prompt is the system prompt, every earlier user
message and answer, and the new user message (what a chat client resends). Two engines on the same
model, prefix caching on and off, serve every turn one at a time (a client waiting for its answer),
alternating which goes first. Per turn: the median time to first token of each, the share of prompt
tokens found cached, and whether both produced the same tokens (greedy: they must).

Writes prefix_cache.json and prefix_cache.png; prints the table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine.bench.report import command, save_figure
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from gateway.cli.common import Parser
from loadtest.machine import machine_info


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]  # printable bytes: ordinary tokens of the default model


def _serve(engine: Engine, rid: str, prompt: list[int], answer_tokens: int) -> Request:
    done = threading.Event()
    req = Request(request_id=rid, prompt_token_ids=prompt,
                  sampling=SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True))
    req.sink = lambda out: out.finish_reason and done.set()
    engine.add_request(req)
    if not done.wait(300) or req.finish_reason != "length":
        raise RuntimeError(f"{rid} ended with {req.finish_reason!r}")
    return req


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    base = EngineConfig(kv_block_size=args.kv_block_size, num_threads=args.threads, seed=args.seed)
    engines = {"on": Engine(replace(base, prefix_caching=True)).start(),
               "off": Engine(replace(base, prefix_caching=False)).start()}
    rng = random.Random(args.seed)
    system = _tokens(rng, args.system_tokens)
    turns: list[dict[str, list[Any]]] = [{"ttft_on": [], "ttft_off": [], "cached": [], "prompt": [], "same": []}
                                         for _ in range(args.turns)]
    try:
        for name, eng in engines.items():  # one request each first: calibration and caches warm, nothing cached
            _serve(eng, f"warmup-{name}", _tokens(random.Random(-1), 300), 2)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("conversations", total=args.conversations * args.turns)
            for c in range(args.conversations):
                history = list(system)
                for t in range(args.turns):
                    prompt = [*history, *_tokens(rng, args.user_tokens)]
                    order = ["on", "off"] if (c + t) % 2 == 0 else ["off", "on"]
                    served = {name: _serve(engines[name], f"c{c}-t{t}-{name}", prompt, args.answer_tokens)
                              for name in order}
                    row = turns[t]
                    row["ttft_on"].append(served["on"].ttft)
                    row["ttft_off"].append(served["off"].ttft)
                    row["cached"].append(served["on"].cached_tokens)
                    row["prompt"].append(len(prompt))
                    row["same"].append(served["on"].output_token_ids == served["off"].output_token_ids)
                    history = [*prompt, *served["on"].output_token_ids]
                    progress.advance(task)
    finally:
        for eng in engines.values():
            eng.shutdown()
    rows = []
    for t, r in enumerate(turns):
        on, off = statistics.median(r["ttft_on"]), statistics.median(r["ttft_off"])
        rows.append({"turn": t + 1, "prompt_tokens_median": statistics.median(r["prompt"]),
                     "cached_share": sum(r["cached"]) / sum(r["prompt"]),
                     "ttft_on_ms_median": on * 1000, "ttft_off_ms_median": off * 1000, "speedup": off / on,
                     "same_tokens": all(r["same"]), "raw": r})
    return {"command": " ".join(["flowprefill bench prefix", *args.argv]), "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(), "config": {**vars(args), "argv": None}, "turns": rows}


def table(results: dict[str, Any]) -> Table:
    t = Table(title="Prefix caching: multi-turn chat, one request at a time (medians)")
    for col in ("turn", "prompt tokens", "cached", "TTFT on (ms)", "TTFT off (ms)", "speed-up", "same tokens"):
        t.add_column(col, justify="right")
    for r in results["turns"]:
        t.add_row(str(r["turn"]), f"{r['prompt_tokens_median']:,.0f}", f"{r['cached_share']:.0%}",
                  f"{r['ttft_on_ms_median']:.1f}", f"{r['ttft_off_ms_median']:.1f}", f"{r['speedup']:.2f}x",
                  "yes" if r["same_tokens"] else "NO")
    return t


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["turns"]
    turns = [r["turn"] for r in rows]
    fig, (ax, share) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1.4, 1]})
    width = 0.38
    ax.bar([t - width / 2 for t in turns], [r["ttft_off_ms_median"] for r in rows], width, label="prefix caching off",
           color="tab:gray")
    ax.bar([t + width / 2 for t in turns], [r["ttft_on_ms_median"] for r in rows], width, label="prefix caching on",
           color="tab:blue")
    for t, r in zip(turns, rows, strict=True):
        ax.annotate(f"{r['speedup']:.1f}x", (t + width / 2, r["ttft_on_ms_median"]), ha="center", va="bottom",
                    fontsize=9)
    ax.set_xticks(turns, [f"turn {t}\n{r['prompt_tokens_median']:,.0f} tok" for t, r in zip(turns, rows, strict=True)])
    ax.set_ylabel("time to first token, median (ms)")
    ax.set_title("TTFT per conversation turn")
    ax.legend()
    share.bar(turns, [100 * r["cached_share"] for r in rows], color="tab:blue")
    share.set_xticks(turns, [f"turn {t}" for t in turns])
    share.set_ylim(0, 100)
    share.set_ylabel("prompt tokens found cached (%)")
    share.set_title(f"Reuse at {results['config']['kv_block_size']}-token blocks")
    save_figure(fig, results, path)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench prefix", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024, help="the system prompt every conversation shares")
    p.add_argument("--user-tokens", type=int, default=128, help="each user message")
    p.add_argument("--answer-tokens", type=int, default=32, help="each answer (greedy, max_tokens)")
    p.add_argument("--kv-block-size", type=int, default=EngineConfig().kv_block_size)
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p


main = command("prefix_cache", build_parser, run, table, plot, ok=lambda r: all(t["same_tokens"] for t in r["turns"]))


if __name__ == "__main__":
    raise SystemExit(main())
