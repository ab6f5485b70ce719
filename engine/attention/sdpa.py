"""torch scaled-dot-product attention: CPU (flash kernel with LSE) and any torch device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import MergedTiles, merge_lse
from engine.core.kv_cache import KVCache


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [n, H, D] -> [1, H, n, D] (a view)


class SDPABackend:
    name = "sdpa"
    merge = staticmethod(merge_lse)

    def tiles(self, q: torch.Tensor) -> MergedTiles:
        return MergedTiles(self, q)

    def tile(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        if causal and k.shape[0] > n:  # bottom-right causal: the keys before the queries', then the square
            before, square = self.tile(q, k[:-n], v[:-n], False), self.tile(q, k[-n:], v[-n:], True)
            lse = torch.stack([before[1], square[1]])
            return merge_lse([before[0], square[0]], [before[1], square[1]]), torch.logsumexp(lse, dim=0)
        n, hq, d = q.shape
        hkv = k.shape[1]
        group = hq // hkv
        if causal or group == 1:
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out, lse = self._attend(_heads_first(q), _heads_first(k), _heads_first(v), causal)
            return out[0].transpose(0, 1), lse[0].transpose(0, 1)
        # Grouped-query attention without copying K/V: the `group` query heads that share a KV
        # head are stacked as extra query rows of that head (valid because the tile has no mask).
        qg = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)
        out, lse = self._attend(qg, _heads_first(k), _heads_first(v), False)
        out = out.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
        lse = lse.view(hkv, group, n).permute(2, 0, 1).reshape(n, hq)
        return out, lse

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
            return out, lse
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal:
            n = q.shape[-2]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores.float(), dim=-1)
        out = (torch.softmax(scores.float(), dim=-1) @ v.float()).to(q.dtype)
        return out, lse

    def decode(self, q: torch.Tensor, layer: int, kv: KVCache, block_tables: list[list[int]],
               lengths: list[int]) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // kv.k[layer].shape[2]
        for i, (table, length) in enumerate(zip(block_tables, lengths, strict=True)):
            k, v = kv.gather(layer, table, length)
            out[i] = F.scaled_dot_product_attention(
                _heads_first(q[i : i + 1]), _heads_first(k), _heads_first(v), enable_gqa=group > 1
            )[0].transpose(0, 1)[0]
        return out
