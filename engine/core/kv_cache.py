"""Paged KV cache: a pool of fixed-size blocks shared by all requests of a worker."""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.core.config import ModelConfig
from engine.core.owner import Owned, owned

if TYPE_CHECKING:
    from engine.core.request import Request

log = logging.getLogger(__name__)


def reserved_tokens(req: Request, reservation: str) -> int:
    """The KV a request takes when its batch forms (EngineConfig.kv_reservation): with `grow`, its
    prefill's and the next token's, whose KV the first decode step writes; with `full`, its answer's too."""
    # (a prompt scored with max_tokens 0 writes no first token: not a block more than the prompt's)
    return req.max_total_tokens if reservation == "full" else min(req.num_tokens + 1, req.max_total_tokens)


class OutOfBlocks(RuntimeError):
    pass


def block_hashes(tokens: Sequence[int], block_size: int, prev: list[bytes] | None = None) -> list[bytes]:
    """Chained content hashes of the full blocks of `tokens`: block i's names its tokens and every
    token before it (128-bit BLAKE2b, so equal hashes mean equal prefixes). `prev`: the hashes
    already known for the leading blocks, extended rather than recomputed."""
    out = list(prev or [])
    for i in range(len(out), len(tokens) // block_size):
        h = hashlib.blake2b(out[-1] if out else b"", digest_size=16)
        h.update(array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes())
        out.append(h.digest())
    return out


class BlockPool(Owned):
    """Accounting of fixed-size KV blocks: what the scheduler (and the simulator) reason about.

    A request owns a block table (list of block ids); token t of it lives in
    block_table[t // block_size] at offset t % block_size.

    Prefix caching (vLLM's and SGLang's automatic prefix caching, by block): a full block whose KV is
    written can be registered under its content hash; a later request whose prompt starts with the
    same blocks takes them (`acquire_prefix`, a reference each) instead of computing them. A block
    is free when no request references it; a free block keeps its content, and stays findable, until
    an allocation takes it: free blocks are reused oldest first, and a finished request's blocks are
    freed last-first, so a prefix's head outlives its tail (a lookup stops at the first missing block).
    """

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError("kv cache needs block_size >= 1 and capacity >= one block")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._refs = [0] * self.num_blocks
        self._hash_of: list[bytes | None] = [None] * self.num_blocks
        self._block_of: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by content (referenced or free)."""
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        return self.allocate_blocks(self.blocks_for(num_tokens))

    def reserve(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table`, in place, to hold `num_tokens` (the blocks it holds count)."""
        if (need := self.blocks_for(num_tokens) - len(block_table)) > 0:
            block_table += self.allocate_blocks(need)

    @owned
    def allocate_blocks(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
            out = []
            for _ in range(n):
                block, _ = self._free.popitem(last=False)
                if (h := self._hash_of[block]) is not None:  # evicted: its content is overwritten
                    del self._block_of[h]
                    self._hash_of[block] = None
                self._refs[block] = 1
                out.append(block)
            return out

    @owned
    def free(self, block_table: list[int]) -> None:
        with self._lock:
            for block in reversed(block_table):
                if self._refs[block] <= 0:  # a bug elsewhere: never let a block be both free and in use
                    log.error("KV block %d freed twice; ignored", block)
                    continue
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._free[block] = None
        block_table.clear()

    # -- prefix caching ------------------------------------------------------------------------
    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` are cached now (reserves nothing)."""
        n = 0
        with self._lock:
            while n < len(hashes) and hashes[n] in self._block_of:
                n += 1
        return n

    @owned
    def acquire_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of `hashes`, one reference each."""
        out: list[int] = []
        with self._lock:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                if self._refs[block] == 0:
                    del self._free[block]
                self._refs[block] += 1
                out.append(block)
        return out

    @owned
    def register(self, block_table: list[int], hashes: list[bytes]) -> None:
        """Make the leading blocks of a table, whose KV is written and whose content `hashes`
        names, findable. A block whose content another block already holds stays private."""
        with self._lock:
            for block, h in zip(block_table, hashes, strict=False):
                if self._hash_of[block] is None and h not in self._block_of:
                    self._hash_of[block] = h
                    self._block_of[h] = block


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

    def export_tokens(self, block_table: list[int], length: int) -> dict[str, torch.Tensor]:
        """A request's first `length` tokens' KV, copied out (`k.{layer}` / `v.{layer}`: [length,
        kv heads, head dim]): what a prefill worker hands off."""
        return {f"{kind}.{layer}": t.clone() for layer in range(len(self.k))
                for kind, t in zip("kv", self.gather(layer, block_table, length), strict=True)}

    def import_tokens(self, block_table: list[int], kv: dict[str, torch.Tensor]) -> None:
        """Write handed-off KV (as `export_tokens` gives it) into a request's blocks."""
        slots = self.slots(block_table, 0, kv["k.0"].shape[0])
        for layer in range(len(self.k)):
            self.write(layer, slots, kv[f"k.{layer}"].to(self.k[0].device, self.k[0].dtype),
                       kv[f"v.{layer}"].to(self.v[0].device, self.v[0].dtype))

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
