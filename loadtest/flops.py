"""How much arithmetic a prefill is, and how much the machine can do: GFLOP/s beside a measured peak.

`prefill_flops` counts a plain forward's work, the way a vLLM-style engine runs it: every layer for
every token (projections, MLP, causal attention over n(n+1)/2 query-key pairs), logits for the last
token. FlowPrefill's serving plan skips the last layer's attention and MLP for all but the last token,
so its achieved rate on this count is what a user compares ("this prompt in this time"), not the rate
its kernels ran at. `matmul_peak` times one large matmul in the run's dtype, on its threads: the
machine's practical peak (a GEMM is the best-tuned kernel torch has; on a CPU also oneDNN's).
"""

from __future__ import annotations

import time

import torch

from engine.core.config import ModelConfig
from engine.model.linear import OneDnnLinear, TorchLinear, select_linear


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Multiply-adds x 2 of a full forward of one `tokens`-token prompt (last token's logits only)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_token_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * cfg.intermediate_size
    pairs = tokens * (tokens + 1) / 2
    attention_layer = 2 * 2 * cfg.num_attention_heads * d * pairs  # scores and P.V
    return cfg.num_hidden_layers * (tokens * per_token_layer + attention_layer) + 2 * h * cfg.vocab_size


def matmul_peak(dtype: torch.dtype, device: str = "cpu", size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of the fastest of `repeats` [size x size] @ [size x size] matmuls (after one warm-up): torch's
    matmul and, on a CPU, oneDNN's linear on a packed weight, the faster of the two (on an AMD CPU with
    AVX-512, torch's fp32 matmul is MKL's AVX2 path: 72 GFLOP/s on one core where oneDNN's runs 200+). On
    CUDA at least 8192-cubed, ten products per timing (a smaller one is launch-bound)."""
    cuda, inner = torch.device(device).type == "cuda", 1
    if cuda:
        # One 2048-cubed bf16 matmul is ~25 us on an H200, under the launch and sync around it: timed alone
        # it read 326 TFLOP/s, and the 8K prefill "191 %" of that. 8192-cubed, ten at a time: ~790.
        size, inner = max(size, 8192), 10
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def matmuls() -> None:
        for _ in range(inner):
            a @ b

    kernels = [matmuls]
    if not cuda and select_linear("auto", torch.device(device), dtype) is not TorchLinear:
        packed = OneDnnLinear(b.t(), None)
        kernels.append(lambda: packed(a))
    best = float("inf")
    with torch.inference_mode():
        for kernel in kernels:
            kernel()
            sync()
            for _ in range(repeats):
                t0 = time.perf_counter()
                kernel()
                sync()
                best = min(best, time.perf_counter() - t0)
    return 2 * size**3 * inner / best / 1e9
