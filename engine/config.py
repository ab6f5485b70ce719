"""Model and engine configuration (dataclasses), read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "llama",
}


@dataclass
class ModelConfig:
    """The subset of a Llama/Qwen2/Qwen3 config.json the engine needs."""

    architecture: str = "Qwen2ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = True  # Qwen2 has a bias on q/k/v
    qk_norm: bool = False  # Qwen3: q and k RMS-normalised per head before the rotation
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    name: str = "flowprefill-default"

    @classmethod
    def from_hf(cls, raw: dict[str, Any], name: str = "") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}: "
                f"FlowPrefill runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "MistralForCausalLM" and raw.get("sliding_window"):
            raise ValueError("unsupported: Mistral with sliding-window attention (sliding_window is set)")
        if arch != "MistralForCausalLM" and raw.get("use_sliding_window"):
            raise ValueError("unsupported: sliding-window attention (use_sliding_window is true)")
        if raw.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true (no Llama or Qwen release uses it)")
        heads = raw["num_attention_heads"]
        # transformers >= 5 writes rope_parameters; 4.x writes rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        family = SUPPORTED_ARCHITECTURES[arch]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),  # transformers' default
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            name=name or raw.get("_name_or_path") or arch,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg = path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        return cls.from_hf(json.loads(cfg.read_text()), name=path.name)


@dataclass
class EngineConfig:
    """Knobs of one engine worker."""

    model: str | None = None  # a local HF checkpoint dir; None = the embedded default model
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | cpu | sdpa | flashinfer (engine/attention)
    row_kernels: str = "auto"  # auto | torch | flashinfer | cpu: RMSNorm, SiLU-and-mul, RoPE (engine/model/kernels.py)
    kv_block_size: int = 256
    kv_capacity_tokens: int = 262_144
    # When a request's KV blocks are taken. grow: its prompt's (and the first answer token's) when its
    # batch forms, the answer's as it grows; when blocks run out an answer is evicted and later
    # recomputed (vLLM's preemption by recompute, TensorRT-LLM's MAX_UTILIZATION). full: prompt +
    # max_tokens when its batch forms, so nothing is ever evicted, at the cost of how many requests
    # fit at once (TensorRT-LLM's GUARANTEED_NO_EVICT).
    kv_reservation: str = "grow"
    max_batch_tokens: int = 2048
    max_waiting: int = 1024  # overload bound: beyond it new requests of every class get a 503
    # Sub-operator split: no single step of a prefill is predicted to run longer than this,
    # which bounds how long a preemption request waits for the running batch to stop.
    step_budget_ms: float = 2.0
    preemptible: bool = True  # False = checkpoints off: one step per operator, no split
    # CUDA only: batches of up to this many tokens replay their row-wise steps as CUDA graphs,
    # captured when the engine starts (engine/model/graphs.py); 0 = always eager.
    cuda_graph_tokens: int = 2048
    # Automatic prefix caching: a prompt whose leading KV blocks another request computed starts
    # after them (engine/kv_cache.py); blocks are reused at the granularity of kv_block_size.
    prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: one per cpu_cores core, else torch's default
    # Cores the engine's compute runs on, e.g. "1" or "2-3" (Linux): the engine thread and torch's intra-op
    # threads are bound to them and the worker's HTTP thread moves to the process's other cores (vLLM's
    # VLLM_CPU_OMP_THREADS_BIND; engine/cpu_affinity.py). None: unpinned.
    cpu_cores: str | None = None
    seed: int = 0
