"""Rotary position embeddings with the scaling types Llama/Qwen2 checkpoints use."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def inv_freq_and_scale(head_dim: int, theta: float, scaling: dict[str, Any], max_pos: int
                       ) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old_ctx = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_pos, factor)
    raise ValueError(f"unsupported rope scaling type {kind!r} (default, linear, llama3, yarn)")


def _yarn(dim: int, theta: float, s: dict[str, Any], max_pos: int, factor: float) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)
    orig = s.get("original_max_position_embeddings") or max_pos

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


Rows = tuple[torch.Tensor, ...]  # what the rotation reads per token row; rows first, sliced with them
FusedRope = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # flashinfer.rope.apply_rope_with_cos_sin_cache


class Rotary:
    """Rotates queries and keys by their tokens' absolute positions.

    In torch (transformers' arithmetic) the rows are each token's cos and sin, looked up once per
    batch and shared by every layer. Callers `reserve` the positions they will use from host-side
    values: checking a device tensor's maximum here would stall the host until the GPU drained its
    queue, at every layer.

    Fused (`use_fused`, FlashInfer's kernel, as vLLM and SGLang use it): the rows are the positions and
    one kernel reads q and k once, rotates them in fp32 from a float32 cos|sin table of every position
    the model accepts, and writes them once, where torch runs five kernels over each. The table is
    made once at its full size: captured CUDA graphs keep its address.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any], max_pos: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq, self.scale = inv_freq_and_scale(head_dim, theta, scaling, max_pos)
        self.inv_freq = self.inv_freq.to(device)
        self.head_dim, self.max_pos = head_dim, max_pos
        self.dtype, self.device = dtype, device
        self._cos = self._sin = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._fused: FusedRope | None = None
        self._cos_sin = torch.empty(0)

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def use_fused(self, kernel: FusedRope | None) -> None:
        """Rotate with `kernel` from now on (None: torch's arithmetic again)."""
        self._fused = kernel
        if kernel is None:
            self._cos_sin = torch.empty(0)
        elif self._cos_sin.shape[0] < self.max_pos:
            half = self._angles(self.max_pos)[:, : self.head_dim // 2]
            self._cos_sin = torch.cat((half.cos(), half.sin()), dim=-1) * self.scale

    def reserve(self, n: int) -> None:
        """Make positions [0, n) available."""
        if self._fused is not None:
            if n > self.max_pos:
                raise ValueError(f"position {n - 1} is past the model's context of {self.max_pos} tokens")
        elif n > self._cos.shape[0]:
            self._grow(n)

    def _angles(self, n: int) -> torch.Tensor:
        return torch.outer(torch.arange(n, dtype=torch.float32, device=self.device), self.inv_freq)

    def _grow(self, n: int) -> None:
        freqs = self._angles(max(n, 2 * self._cos.shape[0], 4096))
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self.scale).to(self.dtype)
        self._sin = (emb.sin() * self.scale).to(self.dtype)

    def rows(self, positions: torch.Tensor) -> Rows:
        """What `apply` reads for tokens at `positions` [n] (every one reserved), rows first."""
        if self._fused is not None:
            return (positions,)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    def span_rows(self, start: int, end: int) -> Rows:
        """`rows` of positions [start, end): views of the reserved table, nothing copied (an 8K-token
        prompt's cos and sin rows are 4 MB in fp32, gathered in 0.58 ms during its prefill's set-up)."""
        if self._fused is not None:
            return (torch.arange(start, end, device=self.device),)
        return self._cos[start:end].unsqueeze(1), self._sin[start:end].unsqueeze(1)

    def row_buffers(self, n: int) -> Rows:
        """Fixed tensors shaped like the rows of n tokens (a CUDA graph bucket's), at position 0."""
        if self._fused is not None:
            return (torch.zeros(n, dtype=torch.long, device=self.device),)
        return (torch.ones(n, 1, self.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(n, 1, self.head_dim, dtype=self.dtype, device=self.device))

    def apply(self, q: torch.Tensor, k: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, q_heads * head_dim] and k [n, kv_heads * head_dim] (views of the fused projection's
        output will do) rotated, as new [n, heads, head_dim] tensors."""
        d = self.head_dim
        if self._fused is not None:
            q, k = self._fused(rows[0], q, k, d, self._cos_sin, is_neox=True)
            return q.view(q.shape[0], -1, d), k.view(k.shape[0], -1, d)
        cos, sin = rows
        return self.rotate(q.view(q.shape[0], -1, d), cos, sin), self.rotate(k.view(k.shape[0], -1, d), cos, sin)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated by cos/sin [n, 1, head_dim] of its rows (HF's rotate-half)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
