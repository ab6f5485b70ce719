"""Load a local Hugging Face checkpoint directory, or build the embedded tiny model (GGUF files: gguf.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.core.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine reads, with its shape, under Hugging Face's names."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.mlp.gate_proj.weight": (i, h),
            f"{p}.mlp.up_proj.weight": (i, h),
            f"{p}.mlp.down_proj.weight": (h, i),
        }
        if cfg.attention_bias:
            shapes |= {f"{p}.self_attn.q_proj.bias": (q,), f"{p}.self_attn.k_proj.bias": (kv,),
                       f"{p}.self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
    return shapes


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_dir(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path}: shard {f} named in the index is missing")
        weights |= load_file(str(path / f))
    check_weights(cfg, weights)
    return cfg, weights


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    for name, shape in expected_shapes(cfg).items():
        if name not in weights:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, config implies {shape}")
    o_bias = "model.layers.0.self_attn.o_proj.bias"
    if o_bias in weights and tuple(weights[o_bias].shape) != (cfg.hidden_size,):
        raise ValueError(f"tensor {o_bias!r} has shape {tuple(weights[o_bias].shape)}")


def tiny_model(seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The embedded tiny model (--model tiny): Qwen2-shaped (see ModelConfig's defaults), seeded weights,
    byte vocabulary."""
    cfg = ModelConfig(eos_token_id=[256, 258])
    gen = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 and name.endswith("norm.weight")
        else torch.randn(shape, generator=gen) * 0.02
        for name, shape in expected_shapes(cfg).items()
    }
    return cfg, weights


def save_checkpoint(cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write a Hugging Face directory (config.json + model.safetensors) that transformers can load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = asdict(cfg)
    model_type = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}.get(cfg.architecture, "llama")
    hf = {k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "head_dim",
                            "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                            "bos_token_id")}
    hf |= {"architectures": [cfg.architecture], "model_type": model_type, "hidden_act": "silu",
           "eos_token_id": cfg.eos_token_id, "torch_dtype": "float32",
           "rope_scaling": cfg.rope_scaling or None}
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
