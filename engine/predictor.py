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

_MEASURED = ("attn_in_s_per_row", "ffn_s_per_row", "attn_s_per_pair")


def cache_dir() -> Path:
    return Path(os.environ.get("FLOWPREFILL_CACHE", "~/.cache/flowprefill")).expanduser()


def profile_key(model: LlamaModel) -> str:
    c = model.cfg
    key = (f"{c.name}-h{c.hidden_size}-l{c.num_hidden_layers}-q{c.num_attention_heads}-kv{c.num_key_value_heads}"
           f"-i{c.intermediate_size}-{model.embed.dtype}-{model.device}-t{torch.get_num_threads()}"
           f"-torch{torch.__version__}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def calibrate(model: LlamaModel) -> OpCost:
    """Time one block of each operator kind (about 0.1 s)."""
    c, dev = model.cfg, model.device
    dtype = model.embed.dtype
    layer = model.layers[0]
    q_n, k_n = 256, 1024
    q = torch.randn(q_n, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
    kv = torch.randn(k_n, c.num_key_value_heads, c.head_dim, dtype=dtype, device=dev)

    def per_row(op: str) -> float:
        # Two block sizes, the costlier per row: per-row cost is not quite flat in the block size.
        worst = 0.0
        for rows in (256, 1024):
            x = torch.randn(rows, c.hidden_size, dtype=dtype, device=dev) * 0.02
            if op == "attn_in":
                pos = torch.arange(rows, device=dev)
                t = _best_time(lambda: model._attn_in(layer, x, pos))  # noqa: B023 - called right here
            else:
                attn = torch.randn(rows, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
                t = _best_time(lambda: model._ffn(layer, x, attn))  # noqa: B023
            worst = max(worst, t / rows)
        return worst

    with torch.inference_mode():
        return OpCost(
            c,
            attn_in_s_per_row=per_row("attn_in"),
            ffn_s_per_row=per_row("ffn"),
            attn_s_per_pair=_best_time(lambda: model.backend.tile(q, kv, kv, False)) / (q_n * k_n),
        )


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
