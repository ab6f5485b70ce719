"""Attention backends, one file each, behind one interface.

Layout everywhere is tokens-first (NHD): q [n, q_heads, head_dim], k/v [n, kv_heads, head_dim].
Prefill attention runs in *tiles* (a block of queries against a block of keys) that return the
log-sum-exp of their scores, so the model can split one long attention into bounded steps and
merge the partial results exactly (the sub-operator split of the preemption design).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from engine.core.kv_cache import KVCache

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def tile(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q against k/v. causal: the queries are the last len(q) positions of the keys
        (a bottom-right causal mask: query j of n sees keys up to len(k) - n + j).
        Returns out [n_q, q_heads, head_dim] and lse [n_q, q_heads]."""
        ...

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
        """Combine tiles' partial attention over disjoint key sets into the exact result."""
        ...

    def decode(self, q: torch.Tensor, layer: int, kv: KVCache, block_tables: list[list[int]],
               lengths: list[int]) -> torch.Tensor:
        """One query token per request against its paged KV: q [B, q_heads, head_dim] -> same shape."""
        ...


def merge_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact merge of softmax-normalised partials (natural-log LSE), all tiles at once."""
    if len(outs) == 1:
        return outs[0]
    lse = torch.stack(lses)  # [tiles, n, heads]
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)
    return (torch.stack(outs) * weights.to(outs[0].dtype)).sum(0)


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   head_dim: int = 128) -> AttentionBackend:
    from engine.attention import cpu, flashinfer, sdpa

    if name == "auto":
        if device.type == "cuda":
            fits = flashinfer.supports(head_dim, dtype) and flashinfer.available()
            name = "flashinfer" if fits else "sdpa"
        elif device.type == "cpu":
            reason = cpu.unsupported(dtype, head_dim)
            if reason:
                log.warning("FlowPrefill's CPU attention kernel is not used (%s); torch's SDPA runs instead", reason)
            name = "sdpa" if reason else "cpu"
        else:
            name = "sdpa"
    if name == "sdpa":
        return sdpa.SDPABackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU (--device cpu)")
        reason = cpu.unsupported(dtype, head_dim)
        if reason:
            raise ValueError(f"the cpu attention backend {reason}")
        return cpu.CPUBackend()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if not flashinfer.available():
            raise ValueError("flashinfer is not installed: pip install 'flowprefill[gpu]'")
        if not flashinfer.supports(head_dim, dtype):
            raise ValueError(f"the flashinfer attention backend needs --dtype bfloat16 or float16 and a head "
                             f"size in {flashinfer.HEAD_DIMS} (this model: {dtype}, head size {head_dim})")
        return flashinfer.FlashInferBackend()
    raise ValueError(f"unknown attention backend {name!r} (auto, cpu, sdpa, flashinfer)")
