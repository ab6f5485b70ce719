"""Piecewise CUDA graphs for short prefills (CUDA only; `EngineConfig.cuda_graph_tokens`).

Below a couple of thousand tokens, an 8B layer's kernels on a datacenter GPU finish sooner than the
host launches them, so an eager prefill is bound by Python and kernel launches while the GPU waits
(on an H200, 512 tokens of an 8B model take 44 ms eagerly, 18 ms with these graphs). Here the row-wise operator steps
of a batch, attention's input (RMSNorm, fused QKV projection, RoPE) and the MLP block (output
projection, residual, RMSNorm, SwiGLU), replay as CUDA graphs captured per layer: one launch for a
step's ~20 kernels. Attention stays eager because its kernels depend on the batch's sequence
lengths; vLLM's piecewise graphs split the forward at the same place.

Graphs read and write fixed buffers, one set per token-count bucket. A batch leases its bucket for
its whole life, suspensions included; a batch that finds its bucket leased (by a suspended batch of
similar size) runs eagerly, as do steps that cover only part of the batch's rows. Pad rows are zero
and every captured operator is row-wise, so pad rows never reach the real ones; attention and the
KV write see only the real rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.model.cost import ATTN_IN, FFN

if TYPE_CHECKING:
    from engine.model.llama import LayerWeights, LlamaModel
    from engine.model.rope import Rows

log = logging.getLogger("flowprefill.engine")

# Token-count buckets: a batch pads up to the next one. Every 128 tokens from 128 on, since above
# a thousand tokens the GPU is busy and padded rows cost device time (the H200 measured 1,100
# tokens padded to 1,280 slower than eager): up to 2,048, padding adds 12.5 % at most past 1K.
BUCKETS = (16, 32, 64, *range(128, 2049, 128), 2560, 3072, 3584, 4096)

Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]


def cuda_capture(device: torch.device) -> Capture:
    """Capture `fn` into a CUDA graph; every graph shares one memory pool. Safe because graphs
    replay one at a time on one stream and nothing they compute outlives a replay except what they
    copy into the bucket's buffers, which live outside the pool."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device)

    def capture(fn: Callable[[], None]) -> Replay:
        # One eager run first, on a side stream: lazy initialisation (cuBLAS handles and
        # workspaces) must happen outside the capture.
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (a worker's HTTP side) may go on meanwhile.
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            fn()
        return graph.replay

    return capture


class GraphBuffers:
    """One bucket: the fixed tensors its graphs read and write, and the graphs."""

    def __init__(self, model: LlamaModel, size: int) -> None:
        c, dev, dtype = model.cfg, model.device, model.embed.dtype
        self.size = size
        with torch.inference_mode(False):  # normal tensors: they are updated in place in any mode
            self.x = torch.zeros(size, c.hidden_size, dtype=dtype, device=dev)
            self.rope = model.rotary.row_buffers(size)
            self.q = torch.zeros(size, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
            self.k = torch.zeros(size, c.num_key_value_heads, c.head_dim, dtype=dtype, device=dev)
            self.v = torch.zeros_like(self.k)
            self.attn = torch.zeros_like(self.q)
        self.replays: dict[tuple[int, str], Replay] = {}
        self.leased = False

    def load(self, x: torch.Tensor, rope: Rows
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy a batch's embeddings and rotary rows in; returns the views of its real rows
        (x, q, k, v, attn) that the forward uses instead of its own tensors."""
        n = x.shape[0]
        self.x[:n].copy_(x)
        self.x[n:].zero_()
        for buf, rows in zip(self.rope, rope, strict=True):
            buf[:n].copy_(rows)
        return self.x[:n], self.q[:n], self.k[:n], self.v[:n], self.attn[:n]

    def replay(self, layer: int, op: str) -> None:
        self.replays[(layer, op)]()


def _attn_in_into(model: LlamaModel, layer: LayerWeights, buf: GraphBuffers) -> None:
    q, k, v = model._attn_in(layer, buf.x, buf.rope)
    buf.q.copy_(q)
    buf.k.copy_(k)
    buf.v.copy_(v)


def _ffn_into(model: LlamaModel, layer: LayerWeights, buf: GraphBuffers) -> None:
    buf.x.copy_(model._ffn(layer, buf.x, buf.attn))


class StepGraphs:
    """The buckets of one model, captured on first use or all at once by `capture_all`."""

    def __init__(self, model: LlamaModel, max_tokens: int, capture: Capture | None = None) -> None:
        self.model = model
        self.sizes = [s for s in BUCKETS if s <= max_tokens]
        if not self.sizes:
            raise ValueError(f"cuda_graph_tokens must be 0 (off) or at least {BUCKETS[0]}, got {max_tokens}")
        self._capture = capture or cuda_capture(model.device)
        self._buckets: dict[int, GraphBuffers] = {}
        self.capture_s = 0.0
        self.failure: str | None = None

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def lease(self, n: int) -> GraphBuffers | None:
        """The buffers of the smallest bucket holding n rows, or None (run eagerly)."""
        size = next((s for s in self.sizes if s >= n), None)
        if size is None:
            return None
        buf = self._buckets.get(size) or self._build(size)
        if buf is None or buf.leased:
            return None
        buf.leased = True
        return buf

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far."""
        return sorted(self._buckets)

    @staticmethod
    def release(buf: GraphBuffers) -> None:
        buf.leased = False

    def capture_all(self) -> None:
        """Capture every bucket now (a worker does this at start, so no request pays for it)."""
        t0 = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            if size not in self._buckets and self._build(size) is None:
                return
        log.info("captured CUDA graphs for prefills of up to %d tokens (%d buckets) in %.1f s",
                 self.max_tokens, len(self.sizes), time.perf_counter() - t0)

    def _build(self, size: int) -> GraphBuffers | None:
        t0 = time.perf_counter()
        buf = GraphBuffers(self.model, size)
        try:
            for i, layer in enumerate(self.model.layers):
                buf.replays[(i, ATTN_IN)] = self._capture(partial(_attn_in_into, self.model, layer, buf))
                buf.replays[(i, FFN)] = self._capture(partial(_ffn_into, self.model, layer, buf))
        except RuntimeError as exc:  # a driver or library that cannot capture: serve eagerly
            log.warning("CUDA graph capture failed, prefills run eagerly: %s", exc)
            self.failure, self.sizes = str(exc), []
            return None
        self.capture_s += time.perf_counter() - t0
        self._buckets[size] = buf
        return buf
