"""Where one prefill's time goes on this device: `torch.profiler` over a prefill of ours (unsplit and
preemptible) and of transformers on the same checkpoint.

    python -m engine.bench.profile --model DIR --device cuda --dtype bfloat16 --tokens 2048

For each: wall time, the device's busy time (sum of kernel times) and so how much of the wall the
device sat idle waiting for the host, and the operators that took the most device time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.contenders import HFPrefill, OurPrefill, device_sync, load_transformers
from engine.bench.stop_latency import random_prompt
from engine.core.config import TINY_MODEL, EngineConfig
from engine.core.kv_cache import KVCache
from engine.model import load_model
from engine.model.calibration import load_cost


def _device_us(evt: Any) -> float:
    if not torch.cuda.is_available():  # on a CPU the device is the host: its operators' own time
        return float(evt.self_cpu_time_total)
    return float(getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0))


def profile_one(name: str, fn: Callable[[], object], sync: Callable[[], None], rows: int) -> dict[str, Any]:
    for _ in range(2):  # warm-up: kernels compiled / autotuned, caches filled
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    wall_s = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    events = prof.key_averages()
    kind = "CUDA" if torch.cuda.is_available() else "CPU"
    busy_us = sum(_device_us(e) for e in events if e.device_type.name == kind)
    top = sorted((e for e in events if _device_us(e) > 0), key=_device_us, reverse=True)[:rows]
    print(f"\n== {name}: wall {wall_s * 1e3:.1f} ms (unprofiled), device busy {busy_us / 1e3:.1f} ms "
          f"({busy_us / 1e3 / (wall_s * 1e3):.0%} of wall)")
    for e in top:
        print(f"  {_device_us(e) / 1e3:9.2f} ms  {e.count:6d}x  {e.key[:100]}")
    return {"wall_s": wall_s, "device_busy_s": busy_us / 1e6,
            "top": [{"op": e.key, "device_ms": _device_us(e) / 1e3, "count": e.count} for e in top]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=TINY_MODEL,
                   help="a local Hugging Face checkpoint directory, a .gguf file, smollm2 or tiny (default: tiny, "
                        "the embedded model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--step-budget-ms", type=float, default=EngineConfig().step_budget_ms)
    p.add_argument("--attention-backend", default=EngineConfig().attention_backend,
                   choices=["auto", "cpu", "sdpa", "flashinfer"])
    p.add_argument("--row-kernels", default=EngineConfig().row_kernels, choices=["auto", "torch", "flashinfer", "cpu"])
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--rows", type=int, default=12, help="operators listed per contender")
    p.add_argument("--no-transformers", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, step_budget_ms=args.step_budget_ms,
                       attention_backend=args.attention_backend, row_kernels=args.row_kernels)
    model, _ = load_model(cfg)
    cost = load_cost(model)
    kv = KVCache(model.cfg, cfg.kv_block_size, args.tokens + cfg.kv_block_size, getattr(torch, cfg.dtype), cfg.device)
    ids = random_prompt(args.tokens, model.cfg.vocab_size, torch.Generator().manual_seed(0))
    table = kv.allocate(args.tokens)
    sync = device_sync(cfg.device)
    print(f"{model.cfg.name}: {args.tokens} tokens, {cfg.dtype} on {cfg.device}, {model.backend.name} attention; "
          f"calibration {cost.attn_in_s_per_row * 1e6:.3f} / {cost.ffn_s_per_row * 1e6:.3f} us per row "
          f"(attn_in / ffn), floor {cost.row_step_floor_s * 1e6:.0f} us, {cost.attn_s_per_pair * 1e12:.2f} ps per pair")
    for name, budget in (("ours unsplit", None), ("ours preemptible", cfg.step_budget_ms / 1000)):
        run = OurPrefill(model, kv, cost, budget, check=budget is not None)
        profile_one(name, lambda run=run: run(ids, table), sync, args.rows)
        print(f"  {run.last_steps} steps")
    if not args.no_transformers:
        del model
        with tempfile.TemporaryDirectory() as tmp:
            hf, note = load_transformers(cfg, Path(tmp))
            if hf is not None:
                profile_one("transformers", lambda: HFPrefill(hf)(ids, table), sync, args.rows)
            else:
                print(f"transformers: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
