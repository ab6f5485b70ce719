"""Paged KV cache: a pool of fixed-size blocks shared by all requests of a worker."""

from __future__ import annotations

import threading
from collections import deque

import torch

from engine.config import ModelConfig


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    """Accounting of fixed-size KV blocks: what the scheduler (and the simulator) reason about.

    A request owns a block table (list of block ids); token t of it lives in
    block_table[t // block_size] at offset t % block_size.
    """

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError("kv cache needs block_size >= 1 and capacity >= one block")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._free: deque[int] = deque(range(self.num_blocks))
        self._lock = threading.Lock()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        n = self.blocks_for(num_tokens)
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
            return [self._free.popleft() for _ in range(n)]

    def free(self, block_table: list[int]) -> None:
        with self._lock:
            self._free.extend(block_table)
        block_table.clear()


class KVCache(BlockPool):
    """The pool's storage: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, block_size: int, capacity_tokens: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(block_size, capacity_tokens)
        shape = (self.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    # -- data ---------------------------------------------------------------------------------
    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices (block * block_size + offset) of tokens [start, end)."""
        device = self.k[0].device
        pos = torch.arange(start, end, device=device)
        blocks = torch.tensor(block_table, dtype=torch.long, device=device)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, layer: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a request's first `length` tokens, contiguous: [length, kv_heads, head_dim]."""
        return self.gather_blocks(layer, self.block_index(block_table, length), length)

    def block_index(self, block_table: list[int], length: int) -> torch.Tensor:
        """The blocks holding a request's first `length` tokens, as a device index (made once per
        batch: building it is a host-to-device copy, which waits for the device's queue)."""
        return torch.tensor(block_table[: self.blocks_for(length)], dtype=torch.long, device=self.k[0].device)

    def gather_blocks(self, layer: int, index: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k[layer].index_select(0, index).flatten(0, 1)[:length]
        v = self.v[layer].index_select(0, index).flatten(0, 1)[:length]
        return k, v
