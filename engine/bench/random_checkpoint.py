"""Write a Hugging Face checkpoint of a real model's shape with random weights, for benchmarks.

Prefill speed depends on a model's shape, not its weights, so a GPU benchmark of (say) Llama 3.1 8B
needs no download: transformers builds the model from the published config.json values, initialises
it on the chosen device (seconds, even for 8B parameters on a GPU) and `save_pretrained` writes the
usual sharded safetensors + index, which the engine and transformers then load like any checkpoint.

    python -m engine.bench.random_checkpoint --shape llama-3.1-8b --device cuda /tmp/llama-8b
    flowprefill bench prefill --model /tmp/llama-8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_LLAMA_3_1_8B: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_parameters": _LLAMA3_ROPE,
    "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False}

# config.json values of published models (architecture-defining fields only); the Llama 3 family
# written as what differs from Llama 3.1 8B.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.2-1b": _LLAMA_3_1_8B | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                                     "head_dim": 64, "rope_parameters": _LLAMA3_ROPE | {"factor": 32.0},
                                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
                   "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
                 "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False},
    # A few-MB stand-in of Llama 3.1's structure (GQA, llama3 RoPE): for tests of this script.
    "tiny-llama": _LLAMA_3_1_8B | {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
                                   "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                   "head_dim": 64, "max_position_embeddings": 4096, "bos_token_id": 1,
                                   "eos_token_id": 2,
                                   "rope_parameters": _LLAMA3_ROPE | {"original_max_position_embeddings": 1024}},
}


def write_random_checkpoint(shape: str, out: Path, device: str = "cpu", dtype: str = "bfloat16",
                            layers: int | None = None, seed: int = 0, max_shard_size: str = "5GB") -> Path:
    """Build `shape` with random weights on `device` and save it to `out`; layers overrides the depth."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    values = dict(SHAPES[shape])
    if layers is not None:
        values["num_hidden_layers"] = layers
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.random_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="directory to write (created)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, help="override the number of layers (a shallower stand-in)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    write_random_checkpoint(args.shape, args.out, args.device, args.dtype, args.layers, args.seed)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors")) / 2**30
    print(f"wrote {args.shape} ({size:.1f} GiB, {args.dtype}) to {args.out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
