"""Attention backends, one file each, behind one interface.

Layout everywhere is tokens-first (NHD): q [n, q_heads, head_dim], k/v [n, kv_heads, head_dim].
Prefill attention runs in *tiles* (a block of queries against a block of keys), so the model can
split one long attention into bounded steps (the sub-operator split of the preemption design): a
backend's `tiles` builds a block of queries' attention a key tile at a time, exactly, by merging the
tiles' partial results through their log-sum-exp or, on the CPU kernel, by carrying the online softmax.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionBackend, MergedTiles, Tiles, merge_lse

__all__ = ["AttentionBackend", "MergedTiles", "Tiles", "merge_lse", "select_backend"]

log = logging.getLogger(__name__)


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
