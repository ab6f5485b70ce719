"""FlowPrefill's own CPU attention kernel (engine/attention/cpu_flash.cpp), built on first use.

Why our own: torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) runs this
engine's default model (head size 32, 4:1 grouped-query heads) at about 50 GFLOP/s on one AVX-512
core in bf16 and 58 in fp32 (8K-token causal tile), vLLM's CPU kernel at 57-67 and 68; this one at
106-130 and 78, by computing bf16 scores and P.V with AVX-512 BF16's dot-product instruction, reading
the keys of each KV head once for all the query heads that share it and skipping the causal
triangle's masked blocks (docs/benchmarks.md, issue 24). inductor's CPU flex attention was timed too:
17 GFLOP/s in bf16, and it cannot return the log-sum-exp the split's tiles need.

The kernel is compiled once per machine by torch's extension builder (g++ and ninja; about 25 s) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) and loaded from there
afterwards. It needs AVX-512 (and AVX-512 BF16 for bfloat16 models); where it cannot be built or
used, `load` says why and the engine keeps torch's SDPA backend.
"""

from __future__ import annotations

import logging
import threading
from functools import cache
from pathlib import Path

import torch

from engine.attention import merge_lse
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_flash.cpp")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the head sizes the kernel is instantiated for
_BASE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
_lock = threading.Lock()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@cache
def build() -> tuple[frozenset[torch.dtype], str]:
    """Build (or load the cached build of) the kernel for this CPU: the dtypes it runs, and why
    none if it cannot be used here."""
    flags = cpu_flags()
    if not {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"} <= flags:
        return frozenset(), "needs a CPU with AVX-512 (avx512f/bw/dq/vl)"
    bf16 = "avx512_bf16" in flags
    name = "flowprefill_attention_" + ("avx512bf16" if bf16 else "avx512")
    cflags = _BASE_FLAGS + (["-mavx512bf16", "-DFLOWPREFILL_BF16=1"] if bf16 else [])
    try:
        from torch.utils.cpp_extension import load

        with _lock:
            load(name=name, sources=[str(SOURCE)], extra_cflags=cflags, is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: torch's SDPA serves instead
        return frozenset(), f"could not be built ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300]})"
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32}), ""


def unsupported(dtype: torch.dtype, head_dim: int) -> str:
    """Why the kernel cannot run this model here ('' if it can); builds it on first call."""
    if head_dim not in HEAD_DIMS:
        return f"head size {head_dim} is not one it is built for {HEAD_DIMS}"
    dtypes, reason = build()
    if reason:
        return reason
    if dtype not in dtypes:
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        return f"runs {kinds} on this CPU, not {str(dtype).removeprefix('torch.')}"
    return ""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, q_heads, d] against k/v [m, kv_heads, d] (causal: bottom-right) -> out, lse [n, q_heads]."""
    return torch.ops.flowprefill.attention(q, k, v, causal)


class CPUBackend:
    """Prefill tiles and decode on the kernel; the merge of tiles is the shared exact LSE merge."""

    name = "cpu"
    merge = staticmethod(merge_lse)

    def tile(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return attention(q, k, v, causal)

    def decode(self, q: torch.Tensor, layer: int, kv: KVCache, block_tables: list[list[int]],
               lengths: list[int]) -> torch.Tensor:
        out = torch.empty_like(q)
        for i, (table, length) in enumerate(zip(block_tables, lengths, strict=True)):
            k, v = kv.gather(layer, table, length)
            out[i] = attention(q[i : i + 1], k, v, False)[0][0]
        return out

