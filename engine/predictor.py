"""The TTFT predictor: an operator cost model of this model on this machine.

Predicted prefill time is linear in token rows (projections, MLP) plus linear in query-key pairs
(attention), so a few timed operator blocks give the whole curve from 16 tokens to the full
context. The profile is cached per model, dtype, device, thread count and torch version; each
start-up re-measures and keeps the faster of cache and new (the least disturbed measurement of what
the machine can do), and the engine then refines a scale factor online from executed batches.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from engine.model.llama import LlamaModel
from engine.model.plan import OpCost

_MEASURED = ("attn_in_s_per_row", "ffn_s_per_row", "attn_s_per_pair", "row_step_floor_s")


def cache_dir() -> Path:
    return Path(os.environ.get("FLOWPREFILL_CACHE", "~/.cache/flowprefill")).expanduser()


def profile_key(model: LlamaModel) -> str:
    c = model.cfg
    key = (f"{c.name}-h{c.hidden_size}-l{c.num_hidden_layers}-q{c.num_attention_heads}-kv{c.num_key_value_heads}"
           f"-i{c.intermediate_size}-{model.embed.dtype}-{model.device}-t{torch.get_num_threads()}"
           f"-torch{torch.__version__}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def calibrate(model: LlamaModel) -> OpCost:
    """Time one block of each operator kind (about 0.1 s).

    On a CPU the cost per row is nearly flat in the block size; a GPU needs thousands of rows to
    fill, so there the per-row cost is taken from large blocks and a small block's time becomes
    the floor under any row-wise step (weights read once, kernels launched once)."""
    c, dev = model.cfg, model.device
    dtype = model.embed.dtype
    layer = model.layers[0]
    gpu = dev.type == "cuda"
    q_n, k_n = (1024, 4096) if gpu else (256, 1024)
    q = torch.randn(q_n, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
    kv = torch.randn(k_n, c.num_key_value_heads, c.head_dim, dtype=dtype, device=dev)
    model.rotary.reserve(4096)

    def block_s(op: str, rows: int) -> float:
        x = torch.randn(rows, c.hidden_size, dtype=dtype, device=dev) * 0.02
        if op == "attn_in":
            rope = model.rotary.at(torch.arange(rows, device=dev))
            return _best_time(lambda: model._attn_in(layer, x, rope))
        attn = torch.randn(rows, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
        return _best_time(lambda: model._ffn(layer, x, attn))

    def per_row(op: str) -> float:
        if gpu:
            return block_s(op, 4096) / 4096
        # Two block sizes, the costlier per row: per-row cost is not quite flat in the block size.
        return max(block_s(op, rows) / rows for rows in (256, 1024))

    with torch.inference_mode():
        cost = OpCost(
            c,
            attn_in_s_per_row=per_row("attn_in"),
            ffn_s_per_row=per_row("ffn"),
            attn_s_per_pair=_best_time(lambda: model.backend.tile(q, kv, kv, False)) / (q_n * k_n),
        )
        if gpu:
            cost.row_step_floor_s = min(block_s("attn_in", 128), block_s("ffn", 128))
    return cost


def load_cost(model: LlamaModel, use_cache: bool = True) -> OpCost:
    cost = calibrate(model)
    if not use_cache:
        return cost
    path = cache_dir() / f"opcost-{profile_key(model)}.json"
    try:
        cached = json.loads(path.read_text())
        for name in _MEASURED:
            setattr(cost, name, min(getattr(cost, name), float(cached[name])))
    except (OSError, ValueError, KeyError):
        pass  # no usable cache: the fresh measurement stands
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({f.name: getattr(cost, f.name) for f in fields(cost) if f.name in _MEASURED}))
    except OSError:
        pass  # a read-only home is no reason not to serve
    return cost


def _best_time(fn: Callable[[], object], repeat: int = 9) -> float:
    """Fastest of several runs: the least disturbed by whatever else the machine is doing."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)
