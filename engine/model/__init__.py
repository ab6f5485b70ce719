"""Model weights, loading and the operator-step forward."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import select_backend
from engine.config import EngineConfig
from engine.model.graphs import StepGraphs
from engine.model.kernels import fuse_rope, select_kernels
from engine.model.linear import select_linear
from engine.model.llama import LlamaModel
from engine.model.loader import default_model, load_checkpoint
from engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["LlamaModel", "load_model", "use_device"]


def load_model(cfg: EngineConfig) -> tuple[LlamaModel, ByteTokenizer | HFTokenizer]:
    if cfg.model:
        model_cfg, weights = load_checkpoint(cfg.model)
    else:
        model_cfg, weights = default_model(cfg.seed)
    device = torch.device(cfg.device)
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
    tokenizer = load_tokenizer(Path(cfg.model) if cfg.model else None, model_cfg.eos_token_id,
                               model_cfg.vocab_size)
    return model, tokenizer


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device. CUDA events, `synchronize`, streams and
    graph capture act on the current device, not on the one the tensors live on: without this, a
    model on cuda:1 would be calibrated, run ahead and captured against cuda:0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)

