"""The contenders of `flowprefill bench prefill` (and `python -m engine.bench.profile`): our prefill
driven step by step as the engine loop drives it, transformers' forward on the same checkpoint, and
interleaved timing that waits for the device."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.core.config import EngineConfig, model_path
from engine.core.kv_cache import KVCache
from engine.core.prefill import PrefillBatch
from engine.core.request import Request
from engine.model import LlamaModel
from engine.model.cost import OpCost, SeqSpan
from engine.model.loader import save_checkpoint, tiny_model


class Chooser:
    """Stands in for Scheduler.chosen: what the engine loop compares with its batch at every step."""

    chosen: PrefillBatch | None = None


class OurPrefill:
    """One whole prefill through PrefillBatch.advance(), as the engine loop drives it."""

    def __init__(self, model: LlamaModel, kv: KVCache, cost: OpCost, budget_s: float | None, check: bool) -> None:
        self.model, self.kv, self.cost, self.budget_s, self.check = model, kv, cost, budget_s, check
        self.chooser = Chooser()
        self.last_steps = 0

    def __call__(self, ids: list[int], block_table: list[int]) -> torch.Tensor:
        req = Request(request_id="bench", prompt_token_ids=ids)
        req.block_table = block_table
        batch = PrefillBatch.on_model([req], [SeqSpan(0, len(ids))], self.model, self.kv, self.cost,
                                      self.budget_s)
        self.last_steps = len(batch.steps)
        if self.check:
            chooser = self.chooser
            chooser.chosen = batch
            while True:
                if chooser.chosen is not batch:  # the engine's per-boundary preemption check
                    raise RuntimeError("the batch was unchosen during a bench run")
                if batch.advance():
                    break
        else:
            while not batch.advance():
                pass
        assert batch.logits is not None
        return batch.logits


class HFPrefill:
    """transformers' forward of the same checkpoint: last-token logits, KV cache built (a prefill)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, ids: list[int], block_table: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], device=self.model.device), logits_to_keep=1)
        return out.logits[0, -1:].float()


def load_transformers(cfg: EngineConfig, model_dir: Path) -> tuple[Any | None, str]:
    """transformers' model of the checkpoint the bench runs (the tiny model is written out first)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, "transformers is not installed (pip install 'flowprefill[dev]')"
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = model_path(cfg.model)
    if path is None:
        save_checkpoint(*tiny_model(cfg.seed), model_dir)
        path = model_dir
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, **gguf, dtype=getattr(torch, cfg.dtype),
                                                 attn_implementation="sdpa")
    model.to(cfg.device).eval()
    return model, ""


def device_sync(device: str) -> Callable[[], None]:
    """Waits for queued device work (CUDA kernels are asynchronous); a no-op on the CPU."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def interleaved(contenders: dict[str, Callable[[], object]], repeats: int,
                tick: Callable[[], None], sync: Callable[[], None] = lambda: None,
                cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds of each contender, `repeats` rounds of A, B, C, ... after one untimed warm-up round.
    `cpu`, if given, gets each run's CPU seconds too (every thread of this process: what the run
    cost the machine, whatever else ran on its cores meanwhile)."""
    for fn in contenders.values():
        fn()
        sync()
        tick()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.process_time() - c0)
            tick()
    return times
