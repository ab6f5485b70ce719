"""SLO classes: a TTFT/TBT target and a priority per class (SPEC: Default SLO classes), and what
becomes of a request of the class once it is predicted to miss its TTFT target (`late`)."""

from __future__ import annotations

from typing import Literal

import msgspec

# What an admitted request of a `late = "shed"` class ends with when it turns hopeless while queued:
# the worker answers it as it answers a request refused at admission (429, Retry-After, the reason).
SHED_REASON = "predicted_slo_miss"
SHED_ERROR = "the request can no longer meet its TTFT target here (predicted while it was queued)"


class SLOClass(msgspec.Struct, frozen=True):
    """`sheddable`: refused at admission (429) when even running it next could not meet its target.
    `late`: what happens to an admitted request once its slack is negative (it can no longer meet
    its target): `serve` it late, within `late_ms` past its target, the scheduler's late tier
    (by that bound, with a guaranteed share of the engine); or `shed` it while it is still queued
    (429, Retry-After and the reason; sheddable classes only). `late_ms` defaults to twice `ttft_ms`."""

    name: str
    ttft_ms: float
    tbt_ms: float
    priority: int
    sheddable: bool = False
    late: Literal["serve", "shed"] = "serve"
    late_ms: float | None = None

    def __post_init__(self) -> None:
        if self.late == "shed" and not self.sheddable:
            raise ValueError(f"SLO class {self.name!r}: late = \"shed\" needs sheddable = true")
        if self.late_ms is not None and not self.late_ms >= 0:
            raise ValueError(f"SLO class {self.name!r}: late_ms must be >= 0")

    @property
    def late_bound_ms(self) -> float:
        """How late past its TTFT target a late request is served at the latest (the late tier's order)."""
        return 2 * self.ttft_ms if self.late_ms is None else self.late_ms


def shed_reason(error: str | None) -> str | None:
    """The drop reason of a request the engine shed while it was queued (None: any other error)."""
    return SHED_REASON if error == SHED_ERROR else None


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
