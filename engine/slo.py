"""SLO classes: a TTFT/TBT target and a priority per class (docs/reference.md: Default SLO classes)."""

from __future__ import annotations

import msgspec


class SLOClass(msgspec.Struct, frozen=True):
    name: str
    ttft_ms: float
    tbt_ms: float
    priority: int
    sheddable: bool = False


DEFAULT_CLASSES: dict[str, SLOClass] = {
    c.name: c
    for c in (
        SLOClass("interactive", ttft_ms=250, tbt_ms=100, priority=3),
        SLOClass("standard", ttft_ms=500, tbt_ms=100, priority=2),
        SLOClass("relaxed", ttft_ms=4000, tbt_ms=200, priority=1, sheddable=True),
        SLOClass("batch", ttft_ms=6000, tbt_ms=200, priority=0, sheddable=True),
    )
}
DEFAULT_CLASS = "standard"
