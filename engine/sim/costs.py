"""Cost models for the simulator: the profiled CPU engine, or an analytical GPU + model.

Both are an `OpCost` (seconds per token row, per query-key pair, per step), the same object the
real engine plans with, so the scheduler sees identical predictions in simulation and reality.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.config import ModelConfig
from engine.model.cost import OpCost


@dataclass(frozen=True)
class GPU:
    name: str
    dense_tflops: float  # bf16 dense tensor-core peak
    hbm_tb_s: float
    matmul_mfu: float = 0.65  # fraction of peak large prefill GEMMs reach
    attn_mfu: float = 0.45  # flash-attention prefill kernels
    launch_s: float = 8e-6  # per operator step (kernel launches, Python)
    # Per finished batch, outside its steps (OpCost.batch_host_s), as measured on an H200 host at 35 req/s
    # of azure-mix: 2.0-2.4 ms completing a batch (first-token sampling, the next decision) and 1.6-1.7 ms
    # more before the next batch's first step.
    batch_host_s: float = 3.8e-3


GPUS = {
    "a100": GPU("A100-SXM4-80GB", 312, 2.0),
    "h100": GPU("H100-SXM5-80GB", 989, 3.35),
    "h200": GPU("H200-SXM-141GB", 989, 4.8),
}

MODELS = {
    "llama-3.1-8b": ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                                attention_bias=False, tie_word_embeddings=False, name="llama-3.1-8b"),
    "qwen2.5-7b": ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                              intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                              num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                              attention_bias=True, tie_word_embeddings=False, name="qwen2.5-7b"),
}


def analytical(model: str, gpu: str, bytes_per_param: int = 2) -> OpCost:
    """Roofline costs of `model` on `gpu` from FLOPs and HBM bandwidth (what-if runs at scale)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: {sorted(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}: {sorted(GPUS)}")
    c, g = MODELS[model], GPUS[gpu]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn_in_flops = 2 * c.hidden_size * (q + 2 * kv)
    ffn_flops = 2 * c.hidden_size * (q + 3 * c.intermediate_size)
    mm = g.dense_tflops * 1e12 * g.matmul_mfu
    # A row-wise step reads its operator's weights once (the MLP's are the largest): a floor.
    ffn_weights = (c.hidden_size * (q + 3 * c.intermediate_size)) * bytes_per_param
    return OpCost(
        c,
        attn_in_s_per_row=attn_in_flops / mm,
        ffn_s_per_row=ffn_flops / mm,
        attn_s_per_pair=4 * c.num_attention_heads * c.head_dim / (g.dense_tflops * 1e12 * g.attn_mfu),
        step_overhead_s=g.launch_s,
        row_step_floor_s=ffn_weights / (g.hbm_tb_s * 1e12),
        batch_host_s=g.batch_host_s,
        # A decode step reads every weight once (the head's too) and each answer's KV; one launch per layer
        # (CUDA graphs replay the rest).
        decode_s=c.num_hidden_layers * (g.launch_s + (c.hidden_size * (q + 2 * kv) + ffn_weights // bytes_per_param)
                                        * bytes_per_param / (g.hbm_tb_s * 1e12))
        + c.vocab_size * c.hidden_size * bytes_per_param / (g.hbm_tb_s * 1e12),
        decode_s_per_seq=(attn_in_flops + ffn_flops) * c.num_hidden_layers / mm,
        decode_s_per_token=c.num_hidden_layers * 2 * kv * bytes_per_param / (g.hbm_tb_s * 1e12),
    )
