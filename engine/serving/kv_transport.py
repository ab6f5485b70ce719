"""Prefill/decode disaggregation, the transport: moving a prefilled request's KV from a prefill worker
to a decode worker.

The prefill worker computes the prompt and the first token, copies the prompt's KV out of its paged
cache as one safetensors blob (engine/core/handoff.py) and gives it to the decode worker's
`/v1/internal/kv/{request id}`:

- same host (the decode worker's URL is a loopback address): through shared memory. The blob is
  written to a file in /dev/shm (a RAM file system) and only its name travels in the POST; the decode
  worker reads it before answering, and the prefill worker deletes it when the POST returns, whatever
  the outcome. Two memory copies instead of a trip through the TCP stack and an HTTP body parser.
- otherwise, or when the decode worker cannot see that file (another container's /dev/shm): the blob
  is the POST's body, over a pooled HTTP connection.

The decode worker keeps the KV in an inbox until the request itself arrives (from the gateway, with
`x-flowprefill-kv-id`), writes it into its own cache and decodes from the first token on.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import torch
from safetensors.torch import load_file, save, save_file

from engine.core.handoff import from_tensors, to_tensors
from engine.core.request import Sampled
from engine.protocol.headers import KV_SHM_HEADER

SHM_DIR = Path(os.environ.get("FLOWPREFILL_SHM_DIR", "/dev/shm"))
SHM_MISSING = "kv_shm_missing"  # the decode worker's error code when it cannot see the file
_SHM_NAME = re.compile(r"flowprefill-kv-[0-9a-f]{32}\.safetensors")


def is_same_host(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_shm(name: str) -> tuple[dict[str, torch.Tensor], Sampled] | None:
    """The KV a same-host prefill worker left in SHM_DIR/name; None if this process cannot see it."""
    if not _SHM_NAME.fullmatch(name):  # only our own files, never a path
        raise ValueError(f"{KV_SHM_HEADER} must name a file flowprefill-kv-<hex>.safetensors")
    path = SHM_DIR / name
    if not path.is_file():
        return None
    return from_tensors(load_file(path))


async def send(client: httpx.AsyncClient, decode_url: str, request_id: str, kv: dict[str, torch.Tensor],
               first: Sampled, transport: str = "auto") -> tuple[str, int]:
    """Hand the KV to the decode worker; returns the transport used ("shm" or "http") and the bytes."""
    url = f"{decode_url.rstrip('/')}/v1/internal/kv/{request_id}"
    tensors = to_tensors(kv, first)
    if transport == "auto" and is_same_host(decode_url) and SHM_DIR.is_dir():
        path = SHM_DIR / f"flowprefill-kv-{uuid.uuid4().hex}.safetensors"
        try:
            save_file(tensors, str(path))
            r = await client.post(url, headers={KV_SHM_HEADER: path.name})
            if not (r.status_code == 404 and SHM_MISSING in r.text):
                r.raise_for_status()
                return "shm", path.stat().st_size
        finally:
            path.unlink(missing_ok=True)
    blob = save(tensors)
    r = await client.post(url, content=blob, headers={"content-type": "application/octet-stream"})
    r.raise_for_status()
    return "http", len(blob)


class KVInbox:
    """Handed-off KV waiting for its request. Entries nobody claims expire, so a request that never
    comes (the client went away between prefill and decode) cannot leak memory."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, dict[str, torch.Tensor], Sampled]] = {}
        self._arrived: dict[str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._items)

    def put(self, request_id: str, kv: dict[str, torch.Tensor], first: Sampled) -> None:
        self._expire()
        self._items[request_id] = (time.monotonic(), kv, first)
        self._arrived.setdefault(request_id, asyncio.Event()).set()

    async def take(self, request_id: str, timeout_s: float) -> tuple[dict[str, torch.Tensor], Sampled]:
        """The KV for `request_id`, waiting up to `timeout_s` for it (TimeoutError after)."""
        event = self._arrived.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        finally:
            self._arrived.pop(request_id, None)
        _, kv, first = self._items.pop(request_id)
        return kv, first

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for rid in [rid for rid, (t, *_) in self._items.items() if t < cutoff]:
            del self._items[rid]
            self._arrived.pop(rid, None)
