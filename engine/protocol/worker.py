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
    # How much slower than its start-up calibration the worker runs now, as its cost model has learned it
    # from measured steps (the correction every batch size shares): 3.0 on a machine slowed threefold.
    machine_factor: float = 1.0


# Each answer also carries the worker's predicted backlog as its headers leave (streamed: once the request
# is admitted; whole: once done, engine/serving/generation.py's `finish`), in
# ORCA's per-request load report (the `endpoint-load-metrics` header that Envoy, gRPC and vLLM read and
# write, TEXT format): between its once-a-second polls of GET /load, a gateway that ranked workers on the
# last poll alone would send a burst almost whole to the one that poll saw least loaded.
LOAD_REPORT_HEADER = "endpoint-load-metrics"
_BACKLOG = "named_metrics.predicted_backlog_s"


def load_report(load: WorkerLoad) -> str:
    """`LOAD_REPORT_HEADER`'s value for this load."""
    return f"TEXT {_BACKLOG}={load.predicted_backlog_s:.6g}"


def reported_backlog_s(value: str) -> float | None:
    """The predicted backlog in an ORCA TEXT load report (None: not TEXT, or no such metric, or not a
    finite number >= 0: another server's report, which a gateway ignores)."""
    kind, _, fields = value.strip().partition(" ")
    if kind != "TEXT":
        return None
    for field in fields.split(","):
        name, _, number = field.strip().partition("=")
        if name == _BACKLOG:
            try:
                x = float(number)
            except ValueError:
                return None
            return x if 0 <= x < float("inf") else None
    return None
