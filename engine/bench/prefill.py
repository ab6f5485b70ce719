"""`flowprefill bench prefill`: what operator-level preemption costs and what it buys, on this machine.

Three measurements on the embedded default model (EngineConfig() defaults, torch threads = all cores),
or on any checkpoint and device (--model DIR --device cuda --dtype bfloat16):

1. Prefill throughput (tokens/s) of our operator-step forward, unsplit (checkpoints off) and
   preemptible (the sub-operator split of the default step budget), against transformers' own
   forward on the very same weights (same dtype and device, sdpa attention, inference mode).
2. Checkpoint overhead: the preemptible forward (split + the engine's per-step "still chosen?"
   identity check) against the same forward with checkpoints off, in percent.
3. Stop latency through the real Engine (scheduler included): a long 'batch' request is
   prefilling when short urgent requests arrive at random moments; each preemption records the
   time from the scheduler's decision to the batch actually stopping. With and without the split.

Shared, noisy CPUs make single timings meaningless, so contenders run round-robin within every
repetition (A, B, C, A, B, C, ...) and every figure is a median. Results: a rich table per
section, bench-results/prefill.json (every raw timing) and bench-results/prefill.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.bench.contenders import HFPrefill, OurPrefill, device_sync, interleaved, load_transformers
from engine.bench.overhead import OverheadSection, median
from engine.bench.prefill_markdown import markdown
from engine.bench.prefill_plot import HF, PREEMPTIBLE, UNSPLIT, plot, size_label
from engine.bench.stop_latency import StopLatencySection, cost_dict, random_prompt
from engine.core.config import TINY_MODEL, EngineConfig
from engine.core.kv_cache import KVCache
from engine.model import LlamaModel, load_model
from engine.model.calibration import load_cost
from engine.model.cost import OpCost, SeqSpan
from gateway.cli.common import Parser, counts
from gateway.cli.console import results_console
from loadtest.flops import matmul_peak, prefill_flops
from loadtest.machine import cpu_count, machine_info

BASE_CONFIG = EngineConfig()  # main() replaces it with the command line's settings


@dataclass(frozen=True)
class Plan:
    """What one run of the bench measures."""

    sizes: tuple[int, ...]
    overhead_sizes: tuple[int, ...]
    stop_sizes: tuple[int, ...]
    repeats: int
    stop_samples: int  # per prompt length, with the split
    stop_samples_unsplit: int  # per prompt length without the split (each sample costs an operator)
    stop_samples_unsplit_long: int  # ... for prompts of 16K tokens and more
    stop_cell_cap_s: float  # stop-latency wall time per (mode, length), samples or not
    sections: tuple[str, ...]


FULL = Plan(sizes=(512, 2048, 8192), overhead_sizes=(2048, 8192), stop_sizes=(512, 2048, 8192, 16384),
            repeats=5, stop_samples=30, stop_samples_unsplit=20, stop_samples_unsplit_long=8,
            stop_cell_cap_s=30.0, sections=("throughput", "overhead", "stop"))
QUICK = Plan(sizes=(512, 2048), overhead_sizes=(2048,), stop_sizes=(512, 2048, 8192),
             repeats=3, stop_samples=12, stop_samples_unsplit=6, stop_samples_unsplit_long=3,
             stop_cell_cap_s=6.0, sections=FULL.sections)


# -- helpers ---------------------------------------------------------------------------------------
# -- section 1: throughput (2 and 3 are mixed in) --------------------------------------------
@dataclass
class Bench(OverheadSection, StopLatencySection):
    console: Console
    progress: Progress
    plan: Plan
    seed: int
    use_transformers: bool
    workdir: Path

    def __post_init__(self) -> None:
        self.cfg = BASE_CONFIG
        self.budget_s = self.cfg.step_budget_ms / 1000
        self.gen = torch.Generator().manual_seed(self.seed)
        self._model: tuple[LlamaModel, OpCost, KVCache] | None = None

    def model(self) -> tuple[LlamaModel, OpCost, KVCache]:
        if self._model is None:
            model, _ = load_model(self.cfg)
            cost = load_cost(model)  # the engine's own predictor, so the split is the engine's split
            longest = max([*self.plan.sizes, *self.plan.overhead_sizes], default=512)
            kv = KVCache(model.cfg, self.cfg.kv_block_size, longest + self.cfg.kv_block_size,
                         getattr(torch, self.cfg.dtype), self.cfg.device)
            self._model = (model, cost, kv)
        return self._model

    def throughput(self) -> dict[str, Any]:
        model, cost, kv = self.model()
        ours = {UNSPLIT: OurPrefill(model, kv, cost, None, check=False),
                PREEMPTIBLE: OurPrefill(model, kv, cost, self.budget_s, check=True)}
        runners: dict[str, Callable[[list[int], list[int]], torch.Tensor]] = dict(ours)
        note = ""
        if self.use_transformers:
            hf_model, note = load_transformers(self.cfg, self.workdir / "checkpoint")
            if hf_model is not None:
                runners[HF] = HFPrefill(hf_model)
        else:
            note = "skipped (--no-transformers)"
        if note:
            self.console.print(f"[yellow]transformers contender: {note}[/]")

        sizes = self.plan.sizes
        task = self.progress.add_task("throughput", total=len(sizes) * (self.plan.repeats + 1) * len(runners))
        raw: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
        steps: dict[str, dict[str, int]] = {name: {} for name in ours}
        check: dict[str, Any] = {}
        for n in sizes:
            self.progress.update(task, description=f"throughput {size_label(n)}")
            ids = random_prompt(n, model.cfg.vocab_size, self.gen)
            table = kv.allocate(n)
            try:
                if n == sizes[0]:
                    check = self._agreement(runners, ids, table)
                calls = {name: (lambda fn=fn, ids=ids, table=table: fn(ids, table)) for name, fn in runners.items()}
                times = interleaved(calls, self.plan.repeats, lambda: self.progress.advance(task),
                                    device_sync(self.cfg.device))
            finally:
                kv.free(table)
            for name, ts in times.items():
                raw[name][str(n)] = ts
            for name, fn in ours.items():
                steps[name][str(n)] = fn.last_steps
        self.progress.update(task, description="throughput")

        median_s = {name: {k: median(v) for k, v in per.items()} for name, per in raw.items()}
        tok_s = {name: {k: int(k) / s for k, s in per.items()} for name, per in median_s.items()}
        ratio = ({name: {k: tok_s[name][k] / tok_s[HF][k] for k in tok_s[name]} for name in (UNSPLIT, PREEMPTIBLE)}
                 if HF in tok_s else {})
        # The TTFT predictor's closed form against what was measured (engine/model/calibration.py).
        predicted_s = {str(n): cost.prefill_s([SeqSpan(0, n)]) for n in sizes}
        # Achieved GFLOP/s (a full forward's FLOPs, loadtest/flops.py) beside a large matmul's, timed now.
        peak = matmul_peak(model.embed.dtype, self.cfg.device)
        gflops = {name: {k: prefill_flops(model.cfg, int(k)) / s / 1e9 for k, s in per.items()}
                  for name, per in median_s.items()}
        result = {"sizes": list(sizes), "contenders": list(runners), "transformers_note": note,
                  "raw_s": raw, "median_s": median_s, "tokens_per_s": tok_s, "predicted_s": predicted_s,
                  "ratio_vs_transformers": ratio, "steps": steps, "agreement": check,
                  "gflops": gflops, "matmul_peak_gflops": peak,
                  "flops": {str(n): prefill_flops(model.cfg, n) for n in sizes},
                  "transformers_setup": {"dtype": self.cfg.dtype, "device": self.cfg.device,
                                         "attn_implementation": "sdpa",
                                         "inference_mode": True, "logits_to_keep": 1, "use_cache": True},
                  "ours_setup": {"driver": "PrefillBatch.advance() per step (as the engine loop)",
                                 "inference_mode": False, "note": "the engine runs prefill in plain grad mode"}}
        self._throughput_table(result)
        return result

    def _agreement(self, runners: dict[str, Callable[[list[int], list[int]], torch.Tensor]],
                   ids: list[int], table: list[int]) -> dict[str, Any]:
        """Same weights, same answer: last-token logits of every contender against ours unsplit."""
        ref = runners[UNSPLIT](ids, table)
        out: dict[str, Any] = {"tokens": len(ids)}
        for name, fn in runners.items():
            if name != UNSPLIT:
                out[f"max_abs_logit_diff_{name.replace(' ', '_')}"] = float((fn(ids, table) - ref).abs().max())
        return out

    def _throughput_table(self, r: dict[str, Any]) -> None:
        t = Table(title=f"1 · Prefill throughput (median of {self.plan.repeats}, interleaved)", title_justify="left")
        t.add_column("prompt", justify="right")
        for name in r["contenders"]:
            t.add_column(f"{name.removeprefix('ours ')}\ntok/s (ms)", justify="right")
        for name in r["ratio_vs_transformers"]:
            t.add_column(f"{name.removeprefix('ours ')}\n/ transformers", justify="right")
        t.add_column("predicted ms\n(error vs unsplit)", justify="right")
        t.add_column(f"preemptible GFLOP/s\n(of {r['matmul_peak_gflops']:,.0f} peak)", justify="right")
        for n in r["sizes"]:
            k = str(n)
            row = [size_label(n)]
            row += [f"{r['tokens_per_s'][name][k]:,.0f} ({r['median_s'][name][k] * 1e3:,.1f})"
                    for name in r["contenders"]]
            for per in r["ratio_vs_transformers"].values():
                x = per[k]
                row.append(f"[{'green' if x >= 1 else 'red'}]{x:.2f}x[/]")
            pred, meas = r["predicted_s"][k], r["median_s"][UNSPLIT][k]
            row.append(f"{pred * 1e3:,.1f} ({(pred - meas) / meas:+.0%})")
            rate = r["gflops"][PREEMPTIBLE][k]
            row.append(f"{rate:,.0f} ({rate / r['matmul_peak_gflops']:.0%})")
            t.add_row(*row)
        self.console.print(t)
        if r["agreement"]:
            diffs = ", ".join(f"{k.removeprefix('max_abs_logit_diff_')}: {v:.2e}"
                              for k, v in r["agreement"].items() if k != "tokens")
            self.console.print(f"  max |logit diff| vs ours unsplit at {size_label(r['agreement']['tokens'])}: {diffs}")


def _finite(x: Any) -> Any:
    """NaN/inf (a statistic of no samples) as null: the JSON stays standard."""
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# -- CLI -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = Parser(  # a mistake: one line, exit 2
        prog="flowprefill bench prefill",
        description="Prefill throughput vs transformers, checkpoint overhead and preemption stop latency, "
                    "on the embedded default model or a checkpoint (--model), on the CPU or a GPU (--device).")
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run: fewer sizes, repeats and samples")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default bench-results)")
    p.add_argument("--repeats", type=int, help="interleaved repetitions per size (default 5, quick 3)")
    p.add_argument("--sizes", type=counts, help="throughput prompt lengths, e.g. 512,2k,8k")
    p.add_argument("--overhead-sizes", type=counts, help="checkpoint-overhead prompt lengths (default 2k,8k)")
    p.add_argument("--stop-sizes", type=counts, help="stop-latency prompt lengths (default 512,2k,8k,16k)")
    p.add_argument("--stop-samples", type=int,
                   help="stop-latency samples per length with the split (default 30, quick 12; "
                        "fewer without the split, where each sample waits out an operator)")
    p.add_argument("--sections", default=",".join(FULL.sections),
                   help="comma-separated subset of: throughput, overhead, stop")
    p.add_argument("--no-transformers", action="store_true", help="leave the transformers contender out")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=TINY_MODEL,
                   help="a local Hugging Face checkpoint directory, a .gguf file, smollm2 or tiny (default: tiny, "
                        "the embedded model)")
    p.add_argument("--device", default=EngineConfig().device, help="cpu (default) or cuda / cuda:N")
    p.add_argument("--dtype", default=EngineConfig().dtype, choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (default float32)")
    p.add_argument("--attention-backend", default=EngineConfig().attention_backend,
                   choices=["auto", "cpu", "sdpa", "flashinfer"], help="as `flowprefill serve` (default auto)")
    p.add_argument("--row-kernels", default=EngineConfig().row_kernels, choices=["auto", "torch", "flashinfer", "cpu"],
                   help="as `flowprefill serve` (default auto)")
    p.add_argument("--step-budget-ms", type=float, default=EngineConfig().step_budget_ms,
                   help="the engine's step budget for the split (default: EngineConfig's)")
    p.add_argument("--cuda-graph-tokens", type=int, default=EngineConfig().cuda_graph_tokens,
                   help="CUDA only: prefills of up to this many tokens replay CUDA graphs (0 = eager)")
    return p


def make_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan:
    base = QUICK if args.quick else FULL
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(FULL.sections)
    if unknown or not sections:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(FULL.sections)}")
    for flag in ("repeats", "stop_samples", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    return Plan(
        sizes=args.sizes or base.sizes,
        overhead_sizes=args.overhead_sizes or base.overhead_sizes,
        stop_sizes=args.stop_sizes or base.stop_sizes,
        repeats=args.repeats or base.repeats,
        stop_samples=args.stop_samples or base.stop_samples,
        stop_samples_unsplit=base.stop_samples_unsplit,
        stop_samples_unsplit_long=base.stop_samples_unsplit_long,
        stop_cell_cap_s=base.stop_cell_cap_s,
        sections=sections,
    )


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = make_plan(args, parser)
    console = results_console()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or cpu_count()
    global BASE_CONFIG
    BASE_CONFIG = EngineConfig(step_budget_ms=args.step_budget_ms, model=args.model, device=args.device,
                               dtype=args.dtype, attention_backend=args.attention_backend,
                               row_kernels=args.row_kernels,
                               cuda_graph_tokens=args.cuda_graph_tokens)
    started, t_start = dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), time.monotonic()
    argv_used = sys.argv[1:] if argv is None else list(argv)
    invoked = getattr(sys, "orig_argv", sys.argv) if argv is None else ["flowprefill", "bench", "prefill", *argv_used]
    with _threads(threads), tempfile.TemporaryDirectory(prefix="flowprefill-bench-") as tmp:
        results: dict[str, Any] = {
            "command": shlex.join(invoked),
            "argv": argv_used,
            "process_argv": list(getattr(sys, "orig_argv", sys.argv)),
            "started_at": started,
            "machine": machine_info(),
            "config": {"quick": args.quick, "seed": args.seed, "plan": asdict(plan),
                       "engine_config": asdict(BASE_CONFIG), "step_budget_ms": BASE_CONFIG.step_budget_ms},
        }
        console.print(f"[bold]FlowPrefill prefill bench[/] · {results['machine']['cpu_count']} CPUs, "
                      f"{threads} torch threads, torch {torch.__version__}"
                      f"{' · quick' if args.quick else ''} · sections: {', '.join(plan.sections)}")
        load = results["machine"].get("loadavg_at_start")
        if load and load[0] > 0.5 * results["machine"]["cpu_count"]:
            console.print(f"[yellow]the machine is busy (load average {load[0]:.1f} on "
                          f"{results['machine']['cpu_count']} CPUs): expect noisy numbers; the split's many "
                          f"short steps suffer most when torch's threads are descheduled[/]")
        progress = Progress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        bench = Bench(console, progress, plan, args.seed, not args.no_transformers, Path(tmp))
        with progress:
            if "throughput" in plan.sections:
                results["throughput"] = bench.throughput()
            if "overhead" in plan.sections:
                results["overhead"] = bench.overhead()
            if "stop" in plan.sections:
                results["stop_latency"] = bench.stop_latency()
        if bench._model is not None:
            results["config"].update(_model_config(bench._model, console))
        results["duration_s"] = time.monotonic() - t_start
        with suppress(OSError):
            results["machine"]["loadavg_at_end"] = os.getloadavg()
    json_path, png_path, md_path = out_dir / "prefill.json", out_dir / "prefill.png", out_dir / "prefill.md"
    json_path.write_text(json.dumps(_finite(results), indent=2, allow_nan=False) + "\n")
    plot(results, png_path)
    md_path.write_text(markdown(results))
    console.print(f"wrote {json_path}, {png_path} and {md_path} (the tables in Markdown) "
                  f"in {results['duration_s']:.0f} s")
    return 0


def _model_config(loaded: tuple[LlamaModel, OpCost, KVCache], console: Console) -> dict[str, Any]:
    """What the results record of the model the bench ran: its calibration, shape, kernels and CUDA graphs."""
    model, cost, _ = loaded
    config = {"calibration": cost_dict(cost), "model": asdict(model.cfg), "attention_backend": model.backend.name,
              "row_kernels": model.kernels.name, "fused_rope": model.rotary.fused}
    graphs = model.graphs
    if graphs is not None:
        config["cuda_graphs"] = {"buckets_captured": graphs.captured, "capture_s": graphs.capture_s,
                                 "failure": graphs.failure}
        console.print(f"CUDA graphs (prefills of up to {BASE_CONFIG.cuda_graph_tokens} tokens): buckets "
                      f"{graphs.captured} captured in {graphs.capture_s:.1f} s"
                      + (f"; capture failed: {graphs.failure}" if graphs.failure else ""))
    return config


if __name__ == "__main__":
    sys.exit(main())
