"""Model weights, loading and the operator-step forward (`llama.py`), and the cost model that sizes its
steps: `OpCost` (`cost.py`: predicted seconds per operator step, corrected online), calibrated at
start-up (`calibration.py`), and the split of a prefill into steps (`plan.py`)."""

from __future__ import annotations

import os
import threading

import torch

from engine.attention import cpu, select_backend
from engine.core.config import EngineConfig, ModelConfig, cache_dir, model_path
from engine.core.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from engine.model.graphs import StepGraphs
from engine.model.kernels import fuse_rope, select_kernels
from engine.model.linear import select_linear
from engine.model.llama import LlamaModel
from engine.model.loader import load_checkpoint, tiny_model

__all__ = ["LlamaModel", "load_model", "use_device"]


def load_model(cfg: EngineConfig, build_cores: set[int] | None = None
               ) -> tuple[LlamaModel, ByteTokenizer | HFTokenizer]:
    """`build_cores`: where a first build of the CPU kernels may run (the cores the process had before
    its engine pinned its compute: the build is a one-time compile, not the engine's work)."""
    device = torch.device(cfg.device)
    build = _cpu_kernels_built_meanwhile(cfg, device, build_cores)
    try:
        model_cfg, weights, tokenizer = load_weights(cfg)
    finally:  # also when loading fails: torch's builder holds a lock file in its build folder until it
        if build is not None:  # ends, and a process that exits meanwhile leaves it there, where every
            build.join()  # later start waits for it without end

    use_device(device)
    dtype = getattr(torch, cfg.dtype)
    backend = select_backend(cfg.attention_backend, device, dtype, model_cfg.head_dim)
    model = LlamaModel(model_cfg, weights, backend, dtype, device, select_linear(cfg.linear, device, dtype))
    model.kernels = select_kernels(cfg.row_kernels, device, dtype, model_cfg.hidden_size, model_cfg.intermediate_size)
    if model.kernels.name in ("flashinfer", "cpu"):
        fuse_rope(model.rotary, model_cfg.num_attention_heads, model_cfg.num_key_value_heads,
                  required=cfg.row_kernels == model.kernels.name, kernels=model.kernels.name)
    if device.type == "cuda" and cfg.cuda_graph_tokens:
        model.graphs = StepGraphs(model, cfg.cuda_graph_tokens)
    return model, tokenizer


def _cpu_kernels_built_meanwhile(cfg: EngineConfig, device: torch.device, cores: set[int] | None
                                 ) -> threading.Thread | None:
    """Where the CPU kernels may serve, their first build (g++, two compilers in child processes: 12 s
    on 2 idle cores, 19 s of CPU) starts now, beside the weights' loading (a GGUF's parsing and
    dequantization: ~5 s for SmolLM2), instead of after it; `cpu.build` is cached, so the backend's
    choice later finds it done. On `cores` where given: confined to `serve`'s one compute core, the
    build and the GGUF's conversion took 27 s of a first start."""
    may_serve = cfg.attention_backend in ("auto", "cpu") or cfg.row_kernels in ("auto", "cpu")
    if device.type != "cpu" or not may_serve:
        return None

    def build() -> None:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)  # this thread, and the compilers it starts
        cpu.build()

    thread = threading.Thread(target=build, name="flowprefill-kernel-build", daemon=True)
    thread.start()
    return thread


def load_weights(cfg: EngineConfig) -> tuple[ModelConfig, dict[str, torch.Tensor], ByteTokenizer | HFTokenizer]:
    """--model's config, weights (on the CPU, as stored or dequantized to float32) and tokenizer."""
    path = model_path(cfg.model)
    if path is None:
        model_cfg, weights = tiny_model(cfg.seed)
        return model_cfg, weights, ByteTokenizer(model_cfg.vocab_size)
    if path.suffix == ".gguf":
        from engine.model.gguf import load_gguf  # gguf is imported only where a GGUF file is read

        return load_gguf(path, cache_dir() / "gguf")
    model_cfg, weights = load_checkpoint(path)
    return model_cfg, weights, load_tokenizer(path, model_cfg.eos_token_id, model_cfg.vocab_size)


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device. CUDA events, `synchronize`, streams and
    graph capture act on the current device, not on the one the tensors live on: without this, a
    model on cuda:1 would be calibrated, run ahead and captured against cuda:0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)

