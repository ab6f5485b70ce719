"""Every finished batch's predicted and measured seconds as JSON lines, when $FLOWPREFILL_BATCH_LOG
names a folder (one file per worker process): what `flowprefill bench planner` replays
(engine/sim/oracle.py's ExactCosts) to tell the cost model's error from the fleet's mechanics.

A line: [request ids, the calibrated model's seconds for the batch's plan, the seconds it took, the
correction its plan was made with, the prompt tokens it computed, when it finished on the engine's
clock, when its first step began, when each of its requests arrived, its host gap]. One line per batch, written on
the engine thread (a few microseconds: a diagnostic, off unless asked for).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from engine.core.observer import EngineObserver

if TYPE_CHECKING:
    from engine.core.engine import Engine
    from engine.core.prefill import PrefillBatch

ENV = "FLOWPREFILL_BATCH_LOG"


class MeasuredBatch(NamedTuple):
    """A batch the engine finished: its requests, what the calibrated model predicted for its plan,
    what it took, and the correction its plan was made with (`Plan.scale`)."""

    ids: Sequence[str]
    base_s: float
    exec_s: float
    plan_scale: float | None = None  # None: not known (the plan is made at the measured factor)
    tokens: int | None = None  # prompt tokens it computed (None: a log written before they were)
    # When it finished, on the engine's clock (seconds; None: a log written before it was said): when in a
    # run a worker ran slow decides attainment at an instance's knee, which no speed per size carries.
    finished_at: float | None = None
    # When its first step began, and when each of its requests arrived at the worker (the engine's clock;
    # None: an older log): the worker's own time between batches, and each request's time in the
    # worker, which the client's TTFT exceeds by what the gateway and the HTTP hops add.
    began_at: float | None = None
    arrived_at: Sequence[float] | None = None
    host_gap_s: float | None = None  # the device idle before its first step while its work waited (prefill.py)


def host_gaps_ms(batches: Sequence[MeasuredBatch]) -> dict[str, float] | None:
    """The host gaps' median and 99th percentile, in ms (None: no batch recorded one)."""
    gaps = sorted(b.host_gap_s * 1000 for b in batches if b.host_gap_s is not None)
    if not gaps:
        return None
    return {"p50": gaps[len(gaps) // 2], "p99": gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))],
            "batches": len(gaps)}


def measured(batch: PrefillBatch, now: float) -> MeasuredBatch:
    return MeasuredBatch([r.request_id for r in batch.requests], batch.steps.base_cost, batch.exec_s,
                         batch.steps.scale, batch.num_tokens, now, batch.began_at,
                         [r.arrival_time for r in batch.requests], batch.host_gap_s)


class BatchLog(EngineObserver):
    def __init__(self, engine: Engine, folder: Path, name: str = "") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"batches-{name}{os.getpid()}.jsonl"
        self._file = self.path.open("a", buffering=1)  # a line at a time: readable while the worker runs
        engine.observers.append(self)

    def on_segment_end(self, batch: PrefillBatch, now: float) -> None:
        if batch.finished:
            self._file.write(json.dumps(measured(batch, now)) + "\n")

    def on_shutdown(self) -> None:
        self._file.close()


def attach(engine: Engine, name: str = "") -> BatchLog | None:
    """A BatchLog on `engine` if $FLOWPREFILL_BATCH_LOG is set (`name` tells apart engines of one process)."""
    folder = os.environ.get(ENV)
    return BatchLog(engine, Path(folder), name) if folder else None


def read(folder: Path) -> list[MeasuredBatch]:
    """Every batch the workers logged in `folder` and its subfolders (`bench planner` keeps one per fleet)."""
    return [b for worker in read_workers(folder) for b in worker]


def read_workers(folder: Path) -> list[list[MeasuredBatch]]:
    """`read`'s batches, a list per worker process (a file each), in the order it logged them."""
    return [[MeasuredBatch(*json.loads(line)) for line in path.read_text().splitlines() if line]
            for path in sorted(folder.rglob("batches-*.jsonl"))]
