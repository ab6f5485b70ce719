"""Prefill/decode disaggregation: moving a prefilled request's KV from a prefill worker to a
decode worker.

The prefill worker computes the prompt and the first token, copies the prompt's KV out of its paged
cache and POSTs it to the decode worker's `/v1/internal/kv/{request id}` as one safetensors blob
(`k.{layer}`, `v.{layer}`: [prompt tokens, kv heads, head dim], plus `first_token`). HTTP over a
pooled connection is the one transport for both cases: on one host it goes over loopback, across hosts
over the network, and the decode worker needs nothing but its HTTP port. The decode worker keeps the
blob in an inbox until the request itself arrives (from the gateway, with `x-flowprefill-kv-id`),
writes it into its own cache and decodes from the first token on.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import torch
from safetensors.torch import load, save

from engine.openai_api import KV_ID_HEADER, KV_TO_HEADER

__all__ = ["KV_ID_HEADER", "KV_TO_HEADER", "KVInbox", "pack", "send", "unpack"]


def pack(kv: dict[str, torch.Tensor], first_token: int) -> bytes:
    tensors = {name: t.contiguous().cpu() for name, t in kv.items()}
    tensors["first_token"] = torch.tensor([first_token], dtype=torch.int64)
    return save(tensors)


def unpack(blob: bytes) -> tuple[dict[str, torch.Tensor], int]:
    tensors = load(blob)
    first = tensors.pop("first_token", None)
    if first is None or first.numel() != 1:
        raise ValueError("handed-off KV has no first_token")
    return tensors, int(first.item())


async def send(client: httpx.AsyncClient, decode_url: str, request_id: str, blob: bytes) -> None:
    r = await client.post(f"{decode_url.rstrip('/')}/v1/internal/kv/{request_id}", content=blob,
                          headers={"content-type": "application/octet-stream"})
    r.raise_for_status()


class KVInbox:
    """Handed-off KV waiting for its request. Entries nobody claims expire, so a request that never
    comes (the client went away between prefill and decode) cannot leak memory."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, dict[str, torch.Tensor], int]] = {}
        self._arrived: dict[str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._items)

    def put(self, request_id: str, kv: dict[str, torch.Tensor], first_token: int) -> None:
        self._expire()
        self._items[request_id] = (time.monotonic(), kv, first_token)
        self._arrived.setdefault(request_id, asyncio.Event()).set()

    async def take(self, request_id: str, timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
        """The KV for `request_id`, waiting up to `timeout_s` for it (TimeoutError after)."""
        event = self._arrived.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        finally:
            self._arrived.pop(request_id, None)
        _, kv, token = self._items.pop(request_id)
        return kv, token

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for rid in [rid for rid, (t, *_) in self._items.items() if t < cutoff]:
            del self._items[rid]
            self._arrived.pop(rid, None)
