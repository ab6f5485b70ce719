"""What an engine worker tells a gateway about itself: its role, and its load (GET /load), on which
the gateway routes (gateway/routing.py)."""

from __future__ import annotations

import msgspec

# colocated: prefill and decode; prefill or decode: one half of prefill/decode disaggregation.
ROLES = ("colocated", "prefill", "decode")


class WorkerLoad(msgspec.Struct, kw_only=True):
    """GET /load's body: one consistent snapshot of the worker's queue (Engine.load)."""

    role: str = "colocated"
    waiting: int = 0  # requests queued for prefill
    decoding: int = 0  # answers being generated
    suspended_batches: int = 0  # prefill batches preempted, waiting to resume
    # Predicted prefill seconds of everything queued or formed there: what a request sent now waits
    # behind, at most (a more urgent one goes ahead of some of it).
    predicted_backlog_s: float = 0.0
    predicted_backlog_by_class_s: dict[str, float] = {}  # the waiting requests' share, by SLO class
    kv_cache_usage: float = 0.0  # share of KV blocks in use
