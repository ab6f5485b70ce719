"""SLO classes: a TTFT/TBT target and a priority per class (docs/reference.md: Default SLO classes), what
becomes of a request of the class once it is predicted to miss its TTFT target (`late`), and how the
request headers choose them (their names: engine/protocol/headers.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from engine.protocol.headers import OBJECTIVE_HEADERS, SLO_CLASS_HEADER, TPOT_HEADERS, TTFT_HEADERS

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


def scaled(classes: Mapping[str, SLOClass], factor: float) -> dict[str, SLOClass]:
    """Every class with its TTFT target and late bound times `factor`: the same SLOs for a model
    `factor` times slower (a benchmark on a real model's CPU speed); TBT targets unchanged."""
    return {k: msgspec.structs.replace(c, ttft_ms=c.ttft_ms * factor, late_ms=c.late_bound_ms * factor)
            for k, c in classes.items()}


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

MAX_TARGET_MS = 3_600_000  # an explicit target of an hour or more is a mistake, not an SLO


class HeaderError(ValueError):
    """A header that names no known class, or a target that is not a number of milliseconds."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of `names` the request sent (a non-empty value), and its value."""
    for name in names:
        if value := headers.get(name):
            return name, value
    return None


def target_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    """An explicit latency target, in milliseconds, from the first of `names` sent; None if none is."""
    if (found := first_header(headers, names)) is None:
        return None
    name, value = found
    try:
        ms = float(value)
    except ValueError:
        raise HeaderError(f"{name} must be a number of milliseconds", name) from None
    if not 0 < ms < MAX_TARGET_MS:  # also refuses nan and inf
        raise HeaderError(f"{name} must be in (0, {MAX_TARGET_MS})", name)
    return ms


def class_named(classes: Mapping[str, SLOClass], name: str) -> SLOClass | None:
    """The class `name` names, in any case (as header names are: `Interactive` is `interactive`);
    None if none. The class returned carries its configured name, the one a response echoes."""
    if (slo := classes.get(name)) is not None:
        return slo
    folded = name.casefold()
    return next((c for key, c in classes.items() if key.casefold() == folded), None)


def named_class(headers: Mapping[str, str], classes: dict[str, SLOClass]) -> SLOClass | None:
    """The class a header names: `x-slo-class`, else the inference objective; None if neither is sent."""
    if (found := first_header(headers, (SLO_CLASS_HEADER, *OBJECTIVE_HEADERS))) is None:
        return None
    header, name = found
    if (slo := class_named(classes, name)) is None:
        raise HeaderError(f"unknown SLO class {name[:64]!r} in {header}; known: {sorted(classes)}", header)
    return slo


def with_tbt_target(slo: SLOClass, headers: Mapping[str, str]) -> SLOClass:
    """The class with the request's explicit time-per-output-token target, if it sent one."""
    tpot = target_ms(headers, TPOT_HEADERS)
    return slo if tpot is None else msgspec.structs.replace(slo, tbt_ms=tpot)


def class_for_ttft(classes: dict[str, SLOClass], ttft_ms: float) -> SLOClass:
    """An explicit TTFT target's class: the tightest whose target it still meets gives its priority
    (the loosest when it meets none), with the target as asked."""
    base = min((c for c in classes.values() if c.ttft_ms >= ttft_ms), key=lambda c: c.ttft_ms,
               default=max(classes.values(), key=lambda c: c.ttft_ms))
    return msgspec.structs.replace(base, ttft_ms=ttft_ms)


def requested_slo(headers: Mapping[str, str], service_tier: str | None, classes: dict[str, SLOClass],
                  default_class: str) -> SLOClass:
    """A worker's reading of a request's SLO, in the gateway's order (gateway/classify.py, which adds
    keys and rules): the class a header names, with an explicit TTFT target if one is sent (a gateway
    sends the time left of its own); else the class of an explicit TTFT target; else the body's
    `service_tier` if it names a class; else the default. An explicit TBT target replaces the class's."""
    ttft = target_ms(headers, TTFT_HEADERS)
    if (slo := named_class(headers, classes)) is not None:
        slo = slo if ttft is None else msgspec.structs.replace(slo, ttft_ms=ttft)
    elif ttft is not None:
        slo = class_for_ttft(classes, ttft)
    else:  # OpenAI's own service_tier values ("auto", "default", ...) name no class
        slo = class_named(classes, service_tier or "") or classes[default_class]
    return with_tbt_target(slo, headers)
