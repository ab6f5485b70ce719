"""Activation buffers a CPU prefill keeps between prefills.

A prefill's hidden states, q, k, v and attention output are as long as its prompt: 28 MB for an
8K-token prompt of the embedded model in fp32. Allocated fresh per prefill, they are written page by
page in the prefill's first steps (2,048 faults per 8 MB buffer), and on a VM whose freed pages go
back to the host each fault costs more again: the first step of an 8K prefill took 5-23 ms against
its 2 ms budget on 2 AMD EPYC cores, later steps of the same shape about 2 ms, and those first steps
were the stop-latency tail. A finished prefill's buffers go back to this pool and the next prefill
of up to their length writes into pages already mapped. A suspended prefill keeps its own (another
batch runs meanwhile), so buffers are leased, not shared; the pool keeps at most `keep` free leases,
the largest ones (any prompt fits a larger lease) up to MAX_KEPT_ROWS, and frees the rest. On CUDA
torch's caching allocator already keeps freed blocks mapped.
"""

from __future__ import annotations

import threading

import torch

from engine.core.config import ModelConfig

MIN_ROWS = 512  # a lease holds at least this many rows, and a power of two: fewer sizes to keep
# Longer leases are not kept: 16K rows of an 8B model's activations in bf16 are 448 MB already.
MAX_KEPT_ROWS = 16384


class Activations:
    """One prefill's buffers, `rows` long: views of the first n rows serve a prompt of n tokens."""

    def __init__(self, cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = rows
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.x = torch.empty(rows, cfg.hidden_size, dtype=dtype, device=device)
        self.q = torch.empty(rows, heads, dim, dtype=dtype, device=device)
        self.k = torch.empty(rows, kv_heads, dim, dtype=dtype, device=device)
        self.v = torch.empty(rows, kv_heads, dim, dtype=dtype, device=device)
        self.attn = torch.empty(rows, heads, dim, dtype=dtype, device=device)

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        """x, q, k, v, attn for n rows."""
        return self.x[:n], self.q[:n], self.k[:n], self.v[:n], self.attn[:n]


class ActivationPool:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, keep: int = 2) -> None:
        self.cfg, self.dtype, self.device, self.keep = cfg, dtype, device, keep
        self._free: list[Activations] = []  # by rows, ascending
        self._lock = threading.Lock()  # a model may prefill on more than one thread (tests, benchmarks)

    def lease(self, n: int) -> Activations:
        """Buffers for n rows: the smallest free lease that fits, else new ones."""
        with self._lock:
            for i, a in enumerate(self._free):
                if a.rows >= n:
                    return self._free.pop(i)
        rows = max(MIN_ROWS, 1 << (n - 1).bit_length())
        with torch.inference_mode(False):  # normal tensors: a prefill outside inference mode may write them too
            return Activations(self.cfg, rows, self.dtype, self.device)

    def release(self, a: Activations) -> None:
        if a.rows > MAX_KEPT_ROWS:
            return
        with self._lock:
            self._free.append(a)
            self._free.sort(key=lambda x: x.rows)
            del self._free[: max(0, len(self._free) - self.keep)]  # the smallest go

    def warm(self, n: int) -> None:
        """Map a lease of min(n, MAX_KEPT_ROWS) rows now, every page written once, and keep it: what
        vLLM's start-up profile run does for its largest batch. Without it the first long prefill
        after a start still faulted its buffers in its first steps: a stop of 23.8 ms at the first
        step of the first 8K prefill, 13.4 ms p99 over 60 stops, where the rest stayed within 6.1 ms
        (one thread, AVX-512 EPYC, `bench prefill --sections stop`)."""
        a = self.lease(min(n, MAX_KEPT_ROWS))
        for t in (a.x, a.q, a.k, a.v, a.attn):
            t.zero_()
        self.release(a)

    @property
    def free_rows(self) -> list[int]:
        with self._lock:
            return [a.rows for a in self._free]
