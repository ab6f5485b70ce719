"""The interface every attention backend implements, and the exact merge of tiles in natural-log LSE
(what a backend's `merge` is when its kernels return natural-log LSEs)."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.core.kv_cache import KVCache


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
