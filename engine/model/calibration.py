"""Calibration of the cost model (`OpCost`, engine/model/cost.py): this model's operators timed on
this machine.

Predicted prefill time is linear in token rows (projections, MLP) plus linear in query-key pairs
(attention), so a few timed operator blocks give the whole curve from 16 tokens to the full
context. The profile is cached per model, dtype, device, thread count and torch version; each
start-up re-measures, and the profile is the median of the last `HISTORY` start-ups' measurements
(robust to a start-up on a busy machine, and to a lucky one; a simulator reads it without adding to
it, so that its runs repeat), and the engine then refines a scale factor per batch size class online
from executed batches (`OpCost.observe`).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.core.config import cache_dir
from engine.core.kv_cache import KVCache
from engine.model.cost import ATTENTION, ATTN_IN, FFN, FFN_IN, MLP, OpCost, SeqSpan
from engine.model.llama import LlamaModel
from engine.model.plan import plan_prefill

_MEASURED = ("attn_in_s_per_row", "ffn_s_per_row", "attn_s_per_pair", "row_step_floor_s", "step_overhead_s",
             "head_s", "head_s_per_row")
# Measured only for a model whose MLP has column slices (LlamaModel.mlp_slices): a profile without them
# (an older one, or a plan.json's) still serves, its FFN cut by rows only.
_MEASURED_SLICED = ("ffn_in_s_per_row", "mlp_s_per_row")
# Decode, measured on a CPU only (a GPU's decode runs through CUDA graphs this timing does not capture):
# what the simulator charges a decode step; kept where measured.
_MEASURED_DECODE = ("decode_s", "decode_s_per_seq", "decode_s_per_token")


# Part of the key: a profile measured by an older calibration is not merged into a newer one's (before
# version 2 a CPU's step floor was never measured, and its cached 0 would have stayed the minimum;
# before version 3 the cache held the fastest measurement ever, not the recent ones; before version 4
# a CPU's operators were timed by the wall, and a start-up beside a busy process ran up to 2x slow; before
# version 5 a CPU's decode gathered each answer's KV, 1.7-2x slower per step with 8 answers of 1K tokens).
PROFILE_VERSION = 5
# Start-ups whose measurements the profile is the median of. The fastest ever (what the cache kept
# before) drifts to the machine's luckiest moment: on 2 shared AMD EPYC cores the cached profile was
# 1.2-1.6x faster per operator than three fresh calibrations of the same hour, the engine's own steps
# ran 1.4-2.1x its predictions in process, and `plan --cost cpu` planned for a machine 2x faster than
# the one that served. A median of five ignores two outliers either way (a two-thread calibration
# beside a busy core ran up to 100x slow).
HISTORY = 5


def profile_key(model: LlamaModel) -> str:
    c = model.cfg
    # The kernels are part of the key: a fused kernel's faster timings must not become the torch ones'.
    key = (f"{c.name}-h{c.hidden_size}-l{c.num_hidden_layers}-q{c.num_attention_heads}-kv{c.num_key_value_heads}"
           f"-i{c.intermediate_size}-{model.embed.dtype}-{model.device}-t{torch.get_num_threads()}"
           f"-torch{torch.__version__}-{model.backend.name}-{model.kernels.name}-{model.linear}"
           f"{'-fused_rope' if model.rotary.fused else ''}-v{PROFILE_VERSION}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


# Row-wise blocks timed on a GPU: every 128 rows (a matmul tile's height) up to where the per-row
# rate is taken. On a CPU the time per row is flat enough that a line does, and timing 32 sizes
# would cost seconds of start-up on two cores.
GPU_BLOCK_ROWS = tuple(range(128, 4097, 128))


def calibrate(model: LlamaModel, block_rows: Sequence[int] | None = None) -> OpCost:
    """Time one block of each operator kind (about 0.1 s; on a GPU also the row-block staircase,
    about 0.5 s for an 8B model on an H200).

    On a CPU the cost per row is nearly flat in the block size; a GPU needs thousands of rows to
    fill, so there the per-row cost is taken from large blocks, and blocks of every multiple of 128
    rows are timed (`OpCost.row_block_s`, `block_rows`): the split (plan.py) then sizes token blocks so
    their tiles fill whole waves."""
    c, dev = model.cfg, model.device
    dtype = model.embed.dtype
    layer = model.layers[0]
    gpu = dev.type == "cuda"
    block_rows = (GPU_BLOCK_ROWS if gpu else ()) if block_rows is None else tuple(sorted(block_rows))
    q_n, k_n = (1024, 4096) if gpu else (256, 1024)
    q = torch.randn(q_n, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
    kv = torch.randn(k_n, c.num_key_value_heads, c.head_dim, dtype=dtype, device=dev)
    model.rotary.reserve(min(c.max_position_embeddings, max((4096, *block_rows))))

    def block_s(op: str, rows: int, repeat: int = 9) -> float:
        x = torch.randn(rows, c.hidden_size, dtype=dtype, device=dev) * 0.02
        if op == ATTN_IN:
            rope = model.rotary.rows(torch.arange(rows, device=dev) % c.max_position_embeddings)
            return _best_time(lambda: model._attn_in(layer, x, rope), dev, repeat)
        if op == MLP:
            return _best_time(lambda: model._mlp_part(layer, 0, x, x), dev, repeat)
        attn = torch.randn(rows, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
        if op == FFN_IN:
            return _best_time(lambda: model._ffn_in(layer, x, attn), dev, repeat)
        return _best_time(lambda: model._ffn(layer, x, attn), dev, repeat)

    with torch.inference_mode():
        tables = {op: [(rows, block_s(op, rows, repeat=5)) for rows in block_rows] for op in (ATTN_IN, FFN)
                  } if block_rows else {}

        def per_row(op: str) -> float:
            if tables:  # the largest timed block
                rows, s = tables[op][-1]
                return s / rows
            if gpu:
                return block_s(op, 4096) / 4096
            # Two block sizes, the costlier per row: per-row cost is not quite flat in the block size.
            return max(block_s(op, rows) / rows for rows in (256, 1024))

        cost = OpCost(
            c,
            attn_in_s_per_row=per_row(ATTN_IN),
            ffn_s_per_row=per_row(FFN),
            attn_s_per_pair=_best_time(lambda: model.backend.tile(q, kv, kv, False), dev) / (q_n * k_n),
            row_block_s=tables,
        )
        if tables:
            cost.row_step_floor_s = min(table[0][1] for table in tables.values())
        elif gpu:
            cost.row_step_floor_s = min(block_s(ATTN_IN, 128), block_s(FFN, 128))
        else:
            cost.step_overhead_s, cost.row_step_floor_s = _cpu_step_costs(model, cost)
        cost.mlp_slices = model.mlp_slices
        if model.mlp_slices > 1:
            cost.ffn_in_s_per_row, cost.mlp_s_per_row = per_row(FFN_IN), per_row(MLP)
        _time_outside_steps(model, cost)
    return cost


def _time_outside_steps(model: LlamaModel, cost: OpCost) -> None:
    """What runs outside a prefill's row-wise steps: its head, and (on a CPU) a decode step."""
    cost.head_s, cost.head_s_per_row = _head_costs(model)
    if model.device.type != "cuda":
        cost.decode_s, cost.decode_s_per_seq, cost.decode_s_per_token = _decode_costs(model)


def _decode_costs(model: LlamaModel, answers: int = 8, short: int = 16, long: int = 1024) -> tuple[float, float, float]:
    """A decode step (`OpCost.decode_step_s`): one answer with `short` tokens of context, `answers` of them,
    and one with `long`; the lines between them are the cost per answer and per context token. On one EPYC
    core: 1.95 ms, 0.24 ms and 0.9 us for the embedded model; 54 ms, 3.5 ms and 11 us for SmolLM2 in fp32
    (its weights read once a step), 0.85 s of its start-up."""
    long = min(long, model.cfg.max_position_embeddings - 1)  # a short-context model's longest
    kv = KVCache(model.cfg, 16, answers * (short + 16) + long + 16, model.embed.dtype, model.device)

    def step_s(n: int, context: int) -> float:
        tables = [kv.allocate(context + 1) for _ in range(n)]
        try:
            return _best_time(lambda: model.decode([0] * n, [context] * n, tables, kv), model.device, repeat=3)
        finally:
            for table in tables:
                kv.free(table)

    one = step_s(1, short)
    per_seq = max(0.0, (step_s(answers, short) - one) / (answers - 1))
    per_token = max(0.0, (step_s(1, long) - one) / (long - short)) if long > short else 0.0
    return one, per_seq, per_token


def _head_costs(model: LlamaModel, rows: int = 16) -> tuple[float, float]:
    """The head over the whole vocabulary (`OpCost.head_s`): one row, and each row more, from one row's
    time and `rows` rows'. A serving batch has a handful of sequences: the line between them is its range."""
    x = torch.randn(rows, model.cfg.hidden_size, dtype=model.embed.dtype, device=model.device) * 0.02
    one = _best_time(lambda: model._logits(x[:1]), model.device, repeat=5)
    many = _best_time(lambda: model._logits(x), model.device, repeat=5)
    per_row = max(0.0, (many - one) / (rows - 1))
    return one, per_row


def _cpu_step_costs(model: LlamaModel, cost: OpCost, repeat: int = 7) -> tuple[float, float]:
    """A CPU step's fixed cost, timed on the prefill's own steps (one token, one step per operator):
    what every step pays (the step loop, dispatch: the fastest attention step, whose one query-key pair
    is nothing), and what a row-wise step pays however few its rows (its weights read once). On 2 AMD
    EPYC cores, one thread, the embedded model: 87-89 us and a further 144 us, where a fixed 20 us had
    been assumed; a 16-token prefill ran 3.7x its prediction, and its size class's correction, borrowed
    by sizes not run yet, predicted a first 400-token prefill 2.1x slow."""
    kv = KVCache(model.cfg, 16, 16, model.embed.dtype, model.device)
    steps = plan_prefill(cost, [SeqSpan(0, 1)], None, last_token_only=True)
    best: dict[str, float] = {}
    for _ in range(repeat):
        table = kv.allocate(1)
        run = model.prefill([[0]], [SeqSpan(0, 1)], [table], kv, steps)
        t0 = time.perf_counter()
        for i in run:
            t1 = time.perf_counter()
            best[steps[i].op] = min(best.get(steps[i].op, t1 - t0), t1 - t0)
            t0 = t1
        kv.free(table)
    overhead = best[ATTENTION]
    return overhead, max(0.0, min(best[ATTN_IN], best[FFN]) - overhead)


def measured_profile(cost: OpCost) -> dict[str, Any]:
    """What a calibration measured, as the cache keeps each start-up's: the per-operator costs and the
    timed row blocks. Also the profile a plan ran with (plan.json's `cost_profile`): the cached profile
    is the median of the last start-ups', and moves when start-ups on a busy machine join it (three busy
    start-ups of five put a 2-core Xeon's FFN at 12.1 us per row, and a stored plan's batches 1.21-1.25x
    longer than under the profile it was made with), so a plan replayed later needs the one it was made
    with (`--cost THAT/plan.json`, read_profile)."""
    sliced = {name: float(getattr(cost, name)) for name in (*_MEASURED_SLICED, *_MEASURED_DECODE)
              if getattr(cost, name) > 0}
    return {name: float(getattr(cost, name)) for name in _MEASURED} | sliced | {"row_block_s": cost.row_block_s}


def load_cost(model: LlamaModel, use_cache: bool = True, record: bool = True) -> OpCost:
    """This start-up's calibration and the cached ones': their median. `record=False` (a simulator's
    probe): the cached profile as it stands, measured only where none is cached, so that a simulation
    of it (`bench goodput --engine sim`, `plan --cost cpu`) repeats from one run to the next as long
    as no engine started between them."""
    if not use_cache:
        return calibrate(model)
    path = cache_dir() / f"opcost-{profile_key(model)}.json"
    history = _read_history(path)
    fresh = None
    if record or not history:
        fresh = calibrate(model)
        history = [*history, measured_profile(fresh)][-HISTORY:]
        _write_history(path, history)
    return _median_of(model, history, fresh)


class StoredProfile(NamedTuple):
    """A CPU cost profile kept in a file (`read_profile`): its start-ups' measurements and what they were
    profiled for, the profile key (`profile_key`), or only the model's name for an older plan.json, which
    did not keep the key."""

    history: list[dict]
    key: str | None
    model_name: str | None = None


def read_profile(path: Path) -> StoredProfile:
    """The profile stored at `path`, not this machine's cached one: a plan.json's `cost_profile` (the
    machine as profiled when that plan ran: replayed a day later under the cache as it then stood, a
    plan's batches were predicted 1.21-1.25x too long, measured_profile) or an engine's cache file
    (`opcost-<key>.json` from FLOWPREFILL_CACHE, the median of its start-ups: a target machine profiled
    by one `serve` start-up there, planned for anywhere). ValueError (one line): unreadable, or neither
    of those with every operator measured."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror})") from None
    except ValueError:
        raise ValueError("not JSON") from None
    if isinstance(doc, dict) and isinstance(doc.get("cost_profile"), dict):
        found = StoredProfile([doc["cost_profile"]], doc["cost_profile"].get("key"), doc.get("model"))
    elif isinstance(doc, dict) and isinstance(doc.get("calibrations"), list):
        if not path.name.startswith("opcost-"):  # what the start-ups were profiled for is in its name
            raise ValueError("an engine's profile cache file says what it profiled in its name, "
                             "opcost-<key>.json: keep that name")
        found = StoredProfile(doc["calibrations"], path.stem.removeprefix("opcost-"))
    else:
        raise ValueError("neither a plan.json with a cost_profile (`plan --cost cpu` writes one) nor an "
                         "engine's profile cache file (opcost-*.json)")
    history = [h for h in found.history if _well_formed(h) and all(name in h for name in _MEASURED)]
    if not history:  # a missing operator would cost nothing, and one instance would do for any load
        raise ValueError(f"its profile has no measurement with all of {', '.join(_MEASURED)}")
    return found._replace(history=history)


def stored_cost(model: LlamaModel, stored: StoredProfile) -> OpCost:
    """A stored profile (`read_profile`) as `model`'s cost model. ValueError (one line): it was profiled
    for another model, thread count, kernels or torch than `model` runs with."""
    if stored.key is not None and stored.key != profile_key(model):
        raise ValueError(f"profiled for {stored.key}, and this engine is {profile_key(model)} (the model, "
                         "--threads, the kernels and torch must be the same)")
    if stored.key is None and stored.model_name != model.cfg.name:
        raise ValueError(f"profiled for the model {stored.model_name}, and this engine runs {model.cfg.name}")
    return _median_of(model, stored.history)


def _median_of(model: LlamaModel, history: list[dict], fresh: OpCost | None = None) -> OpCost:
    """The profile of these start-ups' measurements: per operator their median, per row block size the
    median of those that timed it; the block sizes are `fresh`'s (this start-up's calibration, which
    becomes the profile), else the newest start-up's."""
    cost = fresh
    if cost is None:
        newest = history[-1].get("row_block_s", {})
        cost = OpCost(model.cfg, 0.0, 0.0, 0.0, row_block_s={op: [(int(r), float(t)) for r, t in table]
                                                             for op, table in newest.items()})
    cost.mlp_slices = model.mlp_slices
    for name in (*_MEASURED, *_MEASURED_SLICED, *_MEASURED_DECODE):
        if any(name in h for h in history):
            setattr(cost, name, statistics.median(float(h[name]) for h in history if name in h))
    cost.row_block_s = _median_blocks(cost.row_block_s, [h.get("row_block_s", {}) for h in history])
    return cost


def _write_history(path: Path, history: list[dict]) -> None:
    """Atomically (a file of its own, renamed over the cache): `serve --workers 2` starts its workers
    at once, and a worker reading the other's half-written file would drop the whole history."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            f.write(json.dumps({"calibrations": history}))
        os.replace(f.name, path)
    except OSError:
        pass  # a read-only home is no reason not to serve


def _read_history(path: Path) -> list[dict]:
    """The cached start-ups' measurements, the well-formed ones (none from an unreadable cache)."""
    try:
        history = json.loads(path.read_text())["calibrations"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [h for h in history if _well_formed(h)] if isinstance(history, list) else []


def _well_formed(h: object) -> bool:
    if not isinstance(h, dict):
        return False
    try:
        [float(h[name]) for name in (*_MEASURED, *_MEASURED_SLICED, *_MEASURED_DECODE) if name in h]
        [(int(rows), float(s)) for table in h.get("row_block_s", {}).values() for rows, s in table]
    except (TypeError, ValueError, AttributeError):
        return False
    return True


def _median_blocks(fresh: dict[str, list[tuple[int, float]]], cached: list[dict[str, list[list[float]]]]
                   ) -> dict[str, list[tuple[int, float]]]:
    """Per block size the fresh run timed, the median of the start-ups that timed it."""
    out = {}
    for op, table in fresh.items():
        times = [{int(rows): float(sec) for rows, sec in c.get(op, [])} for c in cached]
        out[op] = [(rows, statistics.median([t[rows] for t in times if rows in t] or [s])) for rows, s in table]
    return out


def _best_time(fn: Callable[[], object], device: torch.device, repeat: int = 9) -> float:
    """Fastest of several runs: the least disturbed by whatever else the machine is doing.

    On a CPU each run is timed on the calling thread's CPU clock, not the wall's: a start-up beside a
    busy process on its core (`serve --workers 2` loading both at once, a peer server compiling
    there) shares the core in slices of a few ms, so no run of an FFN block of 1,024 rows (6 ms)
    went undisturbed, and the fastest by the wall ran 1.3-2.2x slow (one thread, embedded model,
    a spinning process on the same core; three calibrations on each clock). What a busy machine
    costs is the online correction's to learn (`OpCost.observe`), not the profile's."""
    cuda = device.type == "cuda"  # a CPU model on a GPU host is timed as a CPU one
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.thread_time
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return min(times)
