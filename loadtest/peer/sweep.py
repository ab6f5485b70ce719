"""The rate sweep of `flowprefill bench peer`: at every offered rate, every contender gets the same
arrivals and prompts, one contender after another in an order rotated from rate to rate (so none is
always first after a quiet pause, or always last), under the scenario's competing load.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.protocol.slo import DEFAULT_CLASSES, SLOClass
from loadtest import report
from loadtest.peer import split
from loadtest.peer.busy import BusyLoad
from loadtest.peer.client import Arrival, Target, replay, ttft_target_s
from loadtest.results import Record, outcomes
from loadtest.workload import Workload, scale_to_rate

SCENARIOS = ("quiet", "contended", "step", "hogs")
COLLAPSED = 0.5  # two rates in a row below this attainment: higher rates only cost time


@dataclass(frozen=True)
class Scenario:
    """quiet: nothing else runs; contended: busy processes on the engines' cores for the whole run;
    step: the same busy processes switched on halfway through the run's arrivals (a step slowdown);
    hogs: `hogs` busy processes unpinned over `cores` (every core: the servers' and the load
    generator's) for the whole run, as another tenant's jobs on an oversubscribed host."""

    name: str
    cores: tuple[int, ...] = ()
    duty: float = 0.5
    period_ms: float = 10.0
    hogs: int = 0

    def describe(self) -> str:
        if self.name == "quiet":
            return "quiet: nothing else started on the engines' cores"
        if self.name == "hogs":
            return (f"hogs: {self.hogs} busy processes at {self.duty:.0%} duty, unpinned over cores "
                    f"{list(self.cores)}, the whole run")
        load = f"a busy process per core on {list(self.cores)} at {self.duty:.0%} duty ({self.period_ms:g} ms period)"
        return f"contended: {load}, the whole run" if self.name == "contended" else \
            f"step: {load}, switched on halfway through the arrivals"

    def load(self) -> BusyLoad | None:
        """The competing load, not started (None: quiet)."""
        if self.name == "quiet":
            return None
        return BusyLoad(self.cores, self.duty, self.period_ms, hogs=self.hogs if self.name == "hogs" else 0)


def rotation(names: list[str], k: int) -> list[str]:
    """The contenders' order at the k-th rate: the list rotated by k."""
    k %= max(1, len(names))
    return names[k:] + names[:k]


def run_point(target: Target, schedule: list[Arrival], rate: float, scenario: Scenario, max_tokens: int,
              drain_s: float, classes: Mapping[str, SLOClass] = DEFAULT_CLASSES) -> dict[str, Any]:
    """One contender at one rate: its records under the scenario's load, as a report point, measured
    against `classes`' targets (sent with each request where they are not the defaults)."""
    at: list[tuple[float, Callable[[], None]]] = []
    if busy := scenario.load():
        busy.start(paused=scenario.name == "step")
        if scenario.name == "step":
            at.append((schedule[len(schedule) // 2].due_s if schedule else 0.0, busy.resume))
    before = split.read(target.url)
    try:
        sent = None if classes is DEFAULT_CLASSES else classes
        records = asyncio.run(replay(target, schedule, max_tokens, drain_s, at, sent))
    finally:
        load = busy.stop() if busy else None
    pt = point(rate, records, classes)
    for cls, parts in split.split(before, split.read(target.url)).items():  # a gateway: where the time went
        if cls in pt["per_class"]:
            pt["per_class"][cls] |= parts
    pt["loadavg_1m"] = round(os.getloadavg()[0], 2)  # how busy the machine was, whatever else runs on it
    if load:
        pt["busy"] = load
    return pt


def point(rate: float, records: list[Record], classes: Mapping[str, SLOClass] = DEFAULT_CLASSES) -> dict[str, Any]:
    """report.point (attainment, goodput, per-class TTFT p50/p99) plus, per class, its goodput, its
    failures and the latest a request was answered past its target; the send lag overall."""
    pt = report.point(rate, outcomes(records, classes))
    for name, cls in pt["per_class"].items():
        mine = [r for r in records if r.slo_class == name]
        target_s = ttft_target_s(name, classes)
        attained = sum(1 for r in mine if r.ok and r.ttft_s is not None and r.ttft_s <= target_s)
        late = [(r.ttft_s - target_s) * 1000 for r in mine if r.ok and r.ttft_s is not None]
        cls["goodput_rps"] = rate * attained / len(records)
        cls["failed"] = sum(not r.ok for r in mine)
        cls["refused"] = sum(r.status == 429 for r in mine)  # shed by admission, a subset of failed
        cls["late_max_ms"] = round(max(late), 1) if late else None  # < 0: every answer on time, by this margin
        cls["ttft_target_ms"] = target_s * 1000
    lag = np.array([r.lag_s for r in records] or [0.0]) * 1000
    pt["failed"] = sum(not r.ok for r in records)
    pt["errors"] = sorted({r.error for r in records if r.error})[:5]
    pt["send_lag_p99_ms"] = round(float(np.percentile(lag, 99)), 2)
    return pt


def median_point(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate's repeats as one point: the run of median attainment (the lower middle of an even
    count), whole, so its classes' figures stay one run's, with every run's attainment beside it."""
    middle = sorted(runs, key=lambda p: p["attainment"])[(len(runs) - 1) // 2]
    return middle | ({"attainment_runs": [p["attainment"] for p in runs]} if len(runs) > 1 else {})


class Sweep:
    """Every rate, every contender, in rotated order, `repeats` times; a contender past its knee
    stops early."""

    def __init__(self, targets: dict[str, Target], base: Workload, schedule_of: Callable[[Workload], list[Arrival]],
                 max_tokens: int = 1, drain_s: float = 60.0, pause_s: float = 1.0, repeats: int = 1,
                 classes: Mapping[str, SLOClass] = DEFAULT_CLASSES) -> None:
        self.targets, self.base, self.schedule_of, self.classes = targets, base, schedule_of, classes
        self.max_tokens, self.drain_s, self.pause_s, self.repeats = max_tokens, drain_s, pause_s, repeats

    def run(self, rates: list[float], scenario: Scenario,
            progress: Callable[[str, int], None] = lambda *_: None) -> dict[str, list[dict[str, Any]]]:
        """progress(what, 0) as each (rate, contender, repeat) starts, progress(what, 1) once it is done."""
        names = list(self.targets)
        points: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for k, rate in enumerate(sorted(rates)):
            schedule = self.schedule_of(scale_to_rate(self.base, rate))
            runs: dict[str, list[dict[str, Any]]] = {}
            for r in range(self.repeats):
                for position, name in enumerate(rotation(names, k * self.repeats + r)):
                    mine = points[name]
                    if len(mine) >= 2 and all(p["attainment"] < COLLAPSED for p in mine[-2:]):
                        progress(f"{scenario.name} @ {rate:g} req/s: {name} skipped (collapsed)", 1)
                        continue
                    what = f"{scenario.name} @ {rate:g} req/s: {name}" + (f" ({r + 1}/{self.repeats})"
                                                                          if self.repeats > 1 else "")
                    progress(what, 0)
                    pt = run_point(self.targets[name], schedule, rate, scenario, self.max_tokens, self.drain_s,
                                   self.classes)
                    runs.setdefault(name, []).append(pt | {"order": position})
                    time.sleep(self.pause_s)  # the last answers' work, then the next contender starts cold alike
                    progress(f"{what}: {pt['attainment']:.1%} on time", 1)
            for name, mine in runs.items():
                points[name].append(median_point(mine))
        return points
