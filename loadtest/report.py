"""Per-class SLO attainment and goodput, in the goodput.json schema of docs/reference.md (shared by
`bench goodput` and `loadtest`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

ATTAINMENT_TARGET = 0.9


class Outcome(msgspec.Struct, frozen=True):
    """One request's result: its class, its TTFT target and its TTFT (None: failed or unfinished)."""

    slo_class: str
    ttft_target_s: float
    ttft_s: float | None

    @property
    def attained(self) -> bool:
        return self.ttft_s is not None and self.ttft_s <= self.ttft_target_s


def point(rate: float, outcomes: list[Outcome], preemptions: int = 0) -> dict[str, Any]:
    """One sweep point: overall and per-class attainment at offered `rate`."""
    per_class: dict[str, Any] = {}
    for name in sorted({o.slo_class for o in outcomes}):
        mine = [o for o in outcomes if o.slo_class == name]
        ttfts = np.array([o.ttft_s for o in mine if o.ttft_s is not None]) * 1000
        per_class[name] = {
            "n": len(mine),
            "attainment": sum(o.attained for o in mine) / len(mine),
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if len(ttfts) else None,
            "ttft_p99_ms": float(np.percentile(ttfts, 99)) if len(ttfts) else None,
        }
    attainment = sum(o.attained for o in outcomes) / len(outcomes) if outcomes else 0.0
    return {"rate": rate, "attainment": attainment, "goodput_rps": rate * attainment,
            "per_class": per_class, "preemptions": preemptions}


def knee(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The point at the highest rate whose overall attainment is >= the target (None: no such rate)."""
    ok = [p for p in points if p["attainment"] >= ATTAINMENT_TARGET]
    return max(ok, key=lambda p: p["rate"]) if ok else None


def collapsed(points: list[dict[str, Any]], floor: float = 0.5) -> bool:
    """Two consecutive rates below `floor` attainment: the policy is saturated (a rate sweep stops)."""
    return len(points) >= 2 and all(p["attainment"] < floor for p in points[-2:])


def max_goodput(points: list[dict[str, Any]], per_class: bool = False,
                target: float = ATTAINMENT_TARGET) -> float:
    """Highest offered rate whose attainment (every class's, with per_class) is >= target,
    interpolated linearly to where it crosses the target after the last passing point."""

    def att(p: dict[str, Any]) -> float:
        if per_class:
            return min((c["attainment"] for c in p["per_class"].values()), default=0.0)
        return p["attainment"]

    pts = sorted(points, key=lambda p: p["rate"])
    best = 0.0
    for i, p in enumerate(pts):
        if att(p) < target:
            continue
        best = p["rate"]
        nxt = pts[i + 1] if i + 1 < len(pts) else None
        if nxt is not None and att(nxt) < target:
            frac = (att(p) - target) / (att(p) - att(nxt))
            best = p["rate"] + frac * (nxt["rate"] - p["rate"])
    return best


def goodput_note(max_rps: float, max_per_class_rps: float, points: list[dict[str, Any]],
                 target: float = ATTAINMENT_TARGET) -> str | None:
    """Why a max goodput is 0 though a point's goodput (rate x attainment) is not: no rate swept
    reached the target, overall or in every class. None when both max goodputs are measured."""
    if not points or (max_rps > 0 and max_per_class_rps > 0):
        return None
    if max_rps == 0:
        return f"below {target * 100:g} % at every rate"
    return f"no rate with every class >= {target * 100:g} %"


# Under a table of max goodputs: what "below R" in it means.
BELOW_CAPTION = f"below R: attainment below {ATTAINMENT_TARGET * 100:g} % at every rate, down to the lowest, R"


def goodput_label(rps: float, points: list[dict[str, Any]]) -> str:
    """A max goodput as printed: 0 means no rate swept reached the target, "below" the lowest one."""
    if rps > 0 or not points:
        return f"{rps:.2f}"
    return f"below {min(p['rate'] for p in points):g}"


def ratio_label(value: float | None) -> str:
    return "n/a (baseline below every rate)" if value is None else f"{value:.2f}"


def report(workload: dict[str, Any], engine: str, model: str, slo_scale: float, classes: dict[str, Any],
           policies: dict[str, list[dict[str, Any]]], baseline_pairs: Iterable[tuple[str, str]] = (),
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workload": workload, "engine": engine, "model": model, "slo_scale": slo_scale,
        "attainment_target": ATTAINMENT_TARGET, "classes": classes, "policies": {}, "ratios": {},
    }
    for name, pts in policies.items():
        best, best_every = max_goodput(pts), max_goodput(pts, per_class=True)
        out["policies"][name] = {"max_goodput_rps": best, "max_goodput_per_class_rps": best_every,
                                 "max_goodput_note": goodput_note(best, best_every, pts),
                                 "points": sorted(pts, key=lambda p: p["rate"])}
    for a, b in baseline_pairs:
        if a in out["policies"] and b in out["policies"]:
            den = out["policies"][b]["max_goodput_rps"]
            # A baseline that met the target at no rate swept has no ratio (null): "inf" (or 0/0) would
            # claim a number the sweep did not measure, and is not JSON.
            out["ratios"][f"{a}/{b}"] = out["policies"][a]["max_goodput_rps"] / den if den else None
    if extra:
        out |= extra
    return out
