"""Rotary position embeddings with the scaling types Llama/Qwen2 checkpoints use."""

from __future__ import annotations

import math
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


class Rotary:
    """cos/sin tables indexed by absolute token position. Callers `reserve` the positions they
    will use from host-side values: checking a device tensor's maximum here would stall the host
    until the GPU drained its queue, at every layer."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any], max_pos: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq, self.scale = inv_freq_and_scale(head_dim, theta, scaling, max_pos)
        self.inv_freq = self.inv_freq.to(device)
        self.dtype, self.device = dtype, device
        self._cos = self._sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def reserve(self, n: int) -> None:
        """Make positions [0, n) available."""
        if n > self._cos.shape[0]:
            self._grow(n)

    def _grow(self, n: int) -> None:
        size = max(n, 2 * self._cos.shape[0], 4096)
        freqs = torch.outer(torch.arange(size, dtype=torch.float32, device=self.device), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self.scale).to(self.dtype)
        self._sin = (emb.sin() * self.scale).to(self.dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` [n], as [n, 1, head_dim]: looked up once per batch (or decode
        step) and shared by every layer. Every position must have been reserved."""
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated by `at`'s cos/sin of its rows (HF's rotate-half convention)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
