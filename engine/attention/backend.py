"""The interface every attention backend implements, the exact merge of tiles in natural-log LSE
(what a backend's `merge` is when its kernels return natural-log LSEs), and a split prefill's tiles of
one block of queries built on any backend's `tile` and `merge`."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.core.kv_cache import KVCache


class Tiles(Protocol):
    """One block of queries' attention, a key tile at a time: a split prefill's ATTENTION steps of that
    block, which a preemption may separate."""

    def add(self, k: torch.Tensor, v: torch.Tensor, causal: bool, last: bool) -> torch.Tensor | None:
        """Attend to one more tile of keys (causal: the block's diagonal one). last: the block's last tile;
        returns the block's attention [n_q, q_heads, head_dim] (None before)."""
        ...


class MergedTiles:
    """Tiles for any backend with `tile` and `merge`: each tile's result and LSE kept, merged at the end."""

    def __init__(self, backend: AttentionBackend, q: torch.Tensor) -> None:
        self.backend, self.q = backend, q
        self.outs: list[torch.Tensor] = []
        self.lses: list[torch.Tensor] = []

    def add(self, k: torch.Tensor, v: torch.Tensor, causal: bool, last: bool) -> torch.Tensor | None:
        out, lse = self.backend.tile(self.q, k, v, causal)
        self.outs.append(out)
        self.lses.append(lse)
        return self.backend.merge(self.outs, self.lses) if last else None


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

    def tiles(self, q: torch.Tensor) -> Tiles:
        """The block of queries q's attention, to be built a key tile at a time (`MergedTiles(self, q)`
        does it with `tile` and `merge`)."""
        ...

    def decode(self, q: torch.Tensor, layer: int, kv: KVCache, block_tables: list[list[int]],
               lengths: list[int]) -> torch.Tensor:
        """One query token per request against its paged KV: q [B, q_heads, head_dim] -> same shape."""
        ...


def merge_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact merge of softmax-normalised partials (natural-log LSE), all tiles at once."""
    if len(outs) == 1:
        return outs[0]
    # In fp32 at least: weighted in a bf16 model's dtype, each tile's share was rounded to 8 bits before the sum.
    acc = torch.promote_types(outs[0].dtype, torch.float32)
    weights = torch.softmax(torch.stack(lses).to(acc), dim=0).unsqueeze(-1)  # [tiles, n, heads, 1]
    return (torch.stack(outs).to(acc) * weights).sum(0).to(outs[0].dtype)
