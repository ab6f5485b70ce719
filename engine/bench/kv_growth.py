"""`flowprefill bench kv`: what taking KV blocks as answers grow (kv_reservation "grow") buys over
reserving prompt + max_tokens when the batch forms ("full"), on chat requests of a production trace.

Chat clients ask for generous answers (here the chat default, max_tokens 1,024) that end far sooner
(the Azure 2023 conversation trace's GeneratedTokens: median 129). Each request's client takes its
trace's number of tokens and then disconnects: the embedded model never says end-of-sequence, and
to the KV cache an answer the client stops reading ends like one the model stops writing. Requests
arrive at the trace's inter-arrival times scaled to --rate, on a KV cache that holds a fraction of
them. One engine per policy, the same requests, run one after the other (the CPU is shared),
repeated with fresh prompts and alternating which goes first. Per policy, medians over the repeats:
time to serve everything, output tokens/s, TTFT p50/p99, the gap between two tokens of an answer
p50/p99 (what an eviction stretches), answers decoding at once, evictions.

Writes kv_growth.json and kv_growth.png; prints the table.
"""

from __future__ import annotations

import argparse
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
from engine.core.observer import EngineObserver
from engine.core.request import Request, SamplingParams, TokenOutput
from engine.protocol.slo import DEFAULT_CLASSES
from engine.serving.worker import CHAT_DEFAULT_MAX_TOKENS
from gateway.cli.common import Parser
from loadtest.machine import machine_info
from loadtest.workload import ClassRule, head, load_trace, scale_to_rate, synthesize_prompt, traces_dir

POLICIES = ("full", "grow")
SAMPLE_S = 0.05


class _Recompute(EngineObserver):
    def __init__(self) -> None:
        self.tokens = 0

    def on_evict(self, req: Request, now: float) -> None:
        self.tokens += req.remaining_prefill_tokens  # what its recompute computes (the rest is cached)


def _serve(engine: Engine, workload: list[tuple[float, list[int], int, str]], max_tokens: int) -> dict[str, Any]:
    """Replay the workload in real time; returns per-request TTFTs and the sampled timelines."""
    done = threading.Semaphore(0)
    reqs: list[Request] = []
    recompute = _Recompute()
    engine.observers.append(recompute)
    timeline: list[tuple[float, int, float]] = []  # (s since start, answers decoding, KV usage)
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(SAMPLE_S):
            timeline.append((time.monotonic() - t0, engine.num_decoding, engine.kv.usage))

    gaps: list[float] = []  # between two tokens of an answer, as its client sees them (an eviction's too)

    def sink_for(req: Request, answer: int) -> Any:
        last: list[float] = []

        def sink(out: TokenOutput) -> None:  # on the engine thread
            if out.finish_reason:
                done.release()
                return
            now = time.monotonic()
            if last:
                gaps.append(now - last[0])
            last[:] = [now]
            if len(req.output_token_ids) == answer:
                engine.cancel(req.request_id)  # the client has its answer and goes
        return sink

    t0 = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for i, (at, prompt, answer, slo) in enumerate(workload):
        if (wait := t0 + at - time.monotonic()) > 0:
            time.sleep(wait)
        req = Request.for_class(DEFAULT_CLASSES[slo], request_id=f"r{i}", prompt_token_ids=prompt,
                                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        req.sink = sink_for(req, answer)
        reqs.append(req)
        engine.add_request(req)
    for _ in workload:
        if not done.acquire(timeout=600):
            raise RuntimeError("a request never finished")
    elapsed = time.monotonic() - t0
    stop_sampling.set()
    sampler.join()
    engine.observers.remove(recompute)
    if bad := [r.request_id for r in reqs if r.finish_reason not in ("cancelled", "length") or r.ttft is None]:
        raise RuntimeError(f"requests {bad[:5]} ended before their answers")
    ttfts = sorted(r.ttft for r in reqs if r.ttft is not None)
    decoding = [d for _, d, _ in timeline]
    return {"elapsed_s": elapsed, "output_tokens": sum(len(r.output_token_ids) for r in reqs),
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p99_ms": 1000 * _p99(ttfts),
            "token_gap_p50_ms": 1000 * statistics.median(gaps), "token_gap_p99_ms": 1000 * _p99(gaps),
            "decoding_mean": statistics.fmean(decoding) if decoding else 0.0, "decoding_max": max(decoding, default=0),
            "evictions": sum(r.times.evictions for r in reqs), "recomputed_tokens": recompute.tokens,
            "timeline": timeline}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    trace = load_trace(traces_dir() / "azure_llm_2023_conv.csv", ClassRule())
    trace = scale_to_rate(head(trace, args.requests), args.rate)
    base = EngineConfig(kv_capacity_tokens=args.kv_capacity_tokens, kv_block_size=args.kv_block_size,
                        num_threads=args.threads, seed=args.seed)
    engines = {p: Engine(replace(base, kv_reservation=p)).start() for p in POLICIES}
    vocab = engines["grow"].model.cfg.vocab_size
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    try:
        for name, eng in engines.items():  # calibration and caches warm before anything is timed
            _serve(eng, [(0.0, synthesize_prompt(300, vocab, f"warmup-{name}"), 2, "standard")], 4)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("runs", total=args.repeats * len(POLICIES))
            for rep in range(args.repeats):
                workload = [(r.arrival_s, synthesize_prompt(min(r.input_tokens, args.max_prompt_tokens), vocab,
                                                            f"{args.seed}-{rep}-{i}"),
                             max(1, min(r.output_tokens, args.max_tokens)), r.slo_class)
                            for i, r in enumerate(trace.requests)]
                for name in (POLICIES if rep % 2 == 0 else POLICIES[::-1]):
                    runs[name].append(_serve(engines[name], workload, args.max_tokens))
                    progress.advance(task)
    finally:
        for eng in engines.values():
            eng.shutdown()
    summary = {}
    for name, rs in runs.items():
        median = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "timeline"}
        median["output_tokens_per_s"] = statistics.median(r["output_tokens"] / r["elapsed_s"] for r in rs)
        summary[name] = median
    mid = sorted(range(args.repeats), key=lambda i: runs["grow"][i]["elapsed_s"])[args.repeats // 2]
    return {"command": " ".join(["flowprefill bench kv", *args.argv]), "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(), "config": {**vars(args), "argv": None},
            "workload": {"trace": "azure_llm_2023_conv.csv", "requests": len(trace.requests),
                         "prompt_tokens_median": statistics.median(min(r.input_tokens, args.max_prompt_tokens)
                                                                   for r in trace.requests),
                         "answer_tokens_median": statistics.median(min(r.output_tokens, args.max_tokens)
                                                                   for r in trace.requests)},
            "summary": summary, "speedup": summary["full"]["elapsed_s"] / summary["grow"]["elapsed_s"],
            "timelines": {name: rs[mid]["timeline"] for name, rs in runs.items()},
            "raw": {name: [{k: v for k, v in r.items() if k != "timeline"} for r in rs] for name, rs in runs.items()}}


def table(results: dict[str, Any]) -> Table:
    w = results["workload"]
    t = Table(title=f"KV reservation: {w['requests']} chat requests at {results['config']['rate']:g}/s, "
                    f"{results['config']['kv_capacity_tokens']:,}-token cache (medians)")
    for col in ("policy", "served in (s)", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "token gap p50 (ms)",
                "token gap p99 (ms)", "answers at once", "peak", "evictions", "recomputed tok"):
        t.add_column(col, justify="right")
    for name, s in results["summary"].items():
        t.add_row(name, f"{s['elapsed_s']:.1f}", f"{s['output_tokens_per_s']:.0f}", f"{s['ttft_p50_ms']:.0f}",
                  f"{s['ttft_p99_ms']:.0f}", f"{s['token_gap_p50_ms']:.1f}", f"{s['token_gap_p99_ms']:.1f}",
                  f"{s['decoding_mean']:.1f}", f"{s['decoding_max']:.0f}", f"{s['evictions']:.0f}",
                  f"{s['recomputed_tokens']:,.0f}")
    return t


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"full": "tab:gray", "grow": "tab:blue"}
    fig, (answers, usage) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, timeline in results["timelines"].items():
        s = results["summary"][name]
        ts = [t for t, _, _ in timeline]
        label = f"{name} (served in {s['elapsed_s']:.0f} s, TTFT p50 {s['ttft_p50_ms']:.0f} ms)"
        answers.plot(ts, [d for _, d, _ in timeline], color=colors[name], label=label, linewidth=1.2)
        usage.plot(ts, [100 * u for _, _, u in timeline], color=colors[name], label=name, linewidth=1.2)
    answers.set_xlabel("seconds")
    answers.set_ylabel("answers decoding at once")
    answers.set_title("Concurrency the KV cache allows")
    answers.legend(fontsize=8)
    usage.set_xlabel("seconds")
    usage.set_ylabel("KV blocks held (%)")
    usage.set_ylim(0, 105)
    usage.set_title("KV cache held: reserved (full) vs written (grow)")
    usage.legend(fontsize=8)
    save_figure(fig, results, path)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench kv", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--requests", type=int, default=64, help="the trace's first N requests")
    p.add_argument("--rate", type=float, default=8.0, help="offered requests/s (the trace's arrivals, scaled)")
    p.add_argument("--max-tokens", type=int, default=CHAT_DEFAULT_MAX_TOKENS, help="what each client asks for")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer trace prompts are cut to this")
    p.add_argument("--kv-capacity-tokens", type=int, default=12288)
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p


main = command("kv_growth", build_parser, run, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
