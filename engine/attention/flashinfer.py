"""FlashInfer attention (CUDA only; `pip install 'flowprefill[gpu]'`). Chosen automatically on CUDA
for half-precision models whose head size FlashInfer's kernels cover.

Prefill tiles go to `single_prefill_with_kv_cache` (FlashAttention-3 kernels on Hopper, FA2
elsewhere; FlashInfer decides), their partial results are combined by `merge_states`, and decode
reads the paged KV cache in place with `BatchDecodeWithPagedKVCacheWrapper`. FlashInfer compiles
each kernel variant the first time it is used (its JIT cache lives under ~/.cache/flashinfer), so a
worker's first requests on a new machine pay that once.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import MergedTiles
from engine.core.kv_cache import KVCache

HEAD_DIMS = (64, 128, 256)  # what FlashInfer's prefill and decode kernels are built for


def available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None and torch.cuda.is_available()


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim in HEAD_DIMS and dtype in (torch.float16, torch.bfloat16)


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer  # guarded: only imported when selected

        self._fi = flashinfer
        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")

    def tile(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        # Grouped-query heads are native; NHD layout matches ours. The LSE is in FlashInfer's own
        # base, which only `merge` below reads.
        out, lse = self._fi.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True)
        return out, lse

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
        if len(outs) == 1:
            return outs[0]
        out, _ = self._fi.merge_states(torch.stack(outs, dim=1), torch.stack(lses, dim=1).float())
        return out

    def tiles(self, q: torch.Tensor) -> MergedTiles:
        return MergedTiles(self, q)

    def decode(self, q: torch.Tensor, layer: int, kv: KVCache, block_tables: list[list[int]],
               lengths: list[int]) -> torch.Tensor:
        if layer == 0:  # one plan per decode step, shared by every layer
            dev = q.device
            tables = [t[: kv.blocks_for(n)] for t, n in zip(block_tables, lengths, strict=True)]
            indptr = [0]
            for t in tables:
                indptr.append(indptr[-1] + len(t))
            last = [(n - 1) % kv.block_size + 1 for n in lengths]
            self._decode.plan(
                torch.tensor(indptr, dtype=torch.int32, device=dev),
                torch.tensor([b for t in tables for b in t], dtype=torch.int32, device=dev),
                torch.tensor(last, dtype=torch.int32, device=dev),
                q.shape[1], kv.k[0].shape[2], q.shape[2], kv.block_size,
                q_data_type=q.dtype, kv_data_type=kv.k[0].dtype,
            )
        return self._decode.run(q, (kv.k[layer], kv.v[layer]))
