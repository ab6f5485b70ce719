"""What a real run's batch logs and its client say about a worker beyond its speed per batch size: its own
time between batches, the time a request spends outside it, how far a batch's speed strays from its
size's, what its HTTP side's CPU takes from the batches requests arrive in, and what a batch costs more
when the worker was idle before it. A `serve` pilot measures
them (engine/planner/speed.py), and the planner simulates with them (`Planned`).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from engine.core.batch_log import MeasuredBatch
from engine.model.cost import OpCost, size_class
from engine.sim.oracle import factors_by_size, sized

# What a real run's point says of its workers beyond their speed (serve_runs.real_point)
OVERHEADS = ("worker_host_ms", "outside_worker_ms", "serving_cpu_ms", "idle_wake_ms")


class Planned(NamedTuple):
    """What a policy's fleet is simulated with: the cost model (at a pilot's speed, with its worker's host
    time per batch); the time a request spends outside the worker's batches that no cost model holds
    (the gateway's hop, the worker's HTTP, the first token's way back to the client), which comes out of
    every request's TTFT budget (`outside_s`, as the pilot's client measured it); how far one batch's
    speed strays from its size's (`noise`), which queues feel even where the median is right; and the CPU
    a request costs the worker's HTTP side (`serving_s`), on the engine's own core, so that a step that
    requests arrive in runs that much longer (`net_of_serving`)."""

    cost: OpCost
    outside_s: float = 0.0
    noise: float = 0.0  # the sigma of a batch's lognormal speed around its size's (engine/sim/errors.py)
    serving_s: float = 0.0  # the worker's serving side's CPU per request, taken from the step it arrives in
    idle_wake_s: float = 0.0  # what a batch begun on an idle worker takes beyond its size's speed (`idle_wake`)
    drift: float = 0.0  # the sigma of the machine's slow wander (`Wander`), beside each batch's own `noise`
    drift_s: float = 0.0  # the time it forgets itself over


def _ends_before(worker: Sequence[MeasuredBatch]) -> list[tuple[int, float]]:
    """Per batch of one worker whose log says when it began, finished and its requests arrived (its index),
    in the order they began: the latest end of the batches begun before it (-inf: none)."""
    timed = sorted((b.began_at, i) for i, b in enumerate(worker)
                   if b.began_at is not None and b.finished_at is not None and b.arrived_at)
    out, last_end = [], -math.inf
    for _, i in timed:
        out.append((i, last_end))
        last_end = max(last_end, worker[i].finished_at)  # type: ignore[type-var]
    return out


def host_gaps(worker: Sequence[MeasuredBatch]) -> list[float]:
    """One worker's own time between batches: from the end of the last batch it ran to the next batch's
    first step, where no batch was left suspended across that time (a resumed one's segments are not
    logged) and every request of the next one was already at the worker (it waited for nothing but
    itself): the first token sampled and sent, the next decision, the next batch formed."""
    return [worker[i].began_at - last_end for i, last_end in _ends_before(worker)  # type: ignore[operator]
            if max(worker[i].arrived_at) < last_end <= worker[i].began_at]  # type: ignore[arg-type,operator]


def outside_worker(ttfts: dict[str, float], batches: Iterable[MeasuredBatch]) -> list[float]:
    """Per answered request (`ttfts`: its id, its TTFT at the client), the client's TTFT less the
    request's time in the worker: from its arrival there to the end of its last batch."""
    last: dict[str, tuple[float, float]] = {}
    for b in batches:
        if b.finished_at is None or not b.arrived_at:
            continue
        for rid, arrived in zip(b.ids, b.arrived_at, strict=True):
            if rid not in last or b.finished_at > last[rid][0]:
                last[rid] = (b.finished_at, arrived)
    return [ttft - (last[rid][0] - last[rid][1]) for rid, ttft in ttfts.items() if rid in last]


def overheads(workers: Sequence[Sequence[MeasuredBatch]], ttfts: dict[str, float]) -> dict[str, float | None]:
    """A real run's medians of `host_gaps` over its workers and of `outside_worker` (ms; None: its logs
    do not say), as plan.json keeps them."""
    gaps = [g for w in workers for g in host_gaps(w)]
    outside = outside_worker(ttfts, [b for w in workers for b in w])
    return {"worker_host_ms": statistics.median(gaps) * 1000 if gaps else None,
            "outside_worker_ms": statistics.median(outside) * 1000 if outside else None}


def median_overheads(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Per `OVERHEADS` key, the median over the runs that say it (None: none does)."""
    return {k: statistics.median(xs) if (xs := [run[k] for run in runs if run.get(k) is not None]) else None
            for k in OVERHEADS}


def planned_with(cost: OpCost, run: dict[str, Any], noise: Wander | float | None = 0.0) -> Planned:
    """`cost` (at a pilot's speed) with the pilot's host time per batch, its time outside the worker less
    that host time (the simulator charges a batch's host time before its first token), its serving
    side's CPU per request, and how its speed strays (a `Wander`, or one sigma for each batch's own)."""
    host_s = (run.get("worker_host_ms") or 0.0) / 1000
    outside_s = (run.get("outside_worker_ms") or 0.0) / 1000
    strayed = as_wander(noise)
    return Planned(replace(cost, batch_host_s=host_s), max(0.0, outside_s - host_s), strayed.batch,
                   (run.get("serving_cpu_ms") or 0.0) / 1000, (run.get("idle_wake_ms") or 0.0) / 1000,
                   strayed.drift, strayed.drift_s)


def net_of_serving(worker: Sequence[MeasuredBatch], serving_s: float) -> list[MeasuredBatch]:
    """One worker's batches, each less the CPU its serving side took from it: `serving_s` for every
    request that arrived at the worker while the batch ran (in proportion to the batch's own share of
    that time, where it was suspended for part of it). The HTTP side and the engine loop share one core
    and one GIL: on 2 EPYC cores a request cost it 1.9-3.0 ms in 24 pilots (`serve`'s worker /metrics,
    `flowprefill_worker_cpu_seconds_total{threads="serving"}`), and a `chunked:2048` batch ran 2.8-6.0 ms
    longer for each arrival during it (a fit over three runs' 300-450 batches). The simulator charges it
    back where requests arrive (`SimConfig.arrival_cpu_s`), so a burst slows the steps it lands in, as
    it did the real worker's, and a quiet minute does not."""
    arrived = sorted({a for b in worker for a in (b.arrived_at or ())})
    if not serving_s or not arrived:
        return list(worker)
    out = []
    for b in worker:
        if b.began_at is None or b.finished_at is None or b.finished_at <= b.began_at:
            out.append(b)
            continue
        during = bisect.bisect_left(arrived, b.finished_at) - bisect.bisect_right(arrived, b.began_at)
        share = min(1.0, b.exec_s / (b.finished_at - b.began_at))
        out.append(b._replace(exec_s=max(b.exec_s - serving_s * during * share, b.exec_s / 2)))
    return out


def begun_idle(worker: Sequence[MeasuredBatch]) -> list[bool]:
    """Per batch of one worker (in its order): whether the worker was idle before it, its last request
    having arrived after every batch begun before it had ended (nothing suspended, nothing waiting).
    Unknown (an older log without those times): False."""
    idle = [False] * len(worker)
    for i, last_end in _ends_before(worker):
        idle[i] = max(worker[i].arrived_at) > last_end  # type: ignore[arg-type]
    return idle


IDLE_WAKE_MIN_BATCHES = 5  # a size class's busy batches needed to measure its idle ones against
IDLE_WAKE_MIN_IDLE = 20  # idle batches needed to say what waking costs (9 said 11 ms, 100 or more 1-3)


def idle_wake(workers: Sequence[Sequence[MeasuredBatch]]) -> float | None:
    """What a batch begun on an idle worker (`begun_idle`) took beyond what the batches of its size class
    begun on a busy one ran at (their median speed): the median of that excess over the idle ones, in
    seconds (None: none to measure). The worker's thread wakes from its wait, its caches are cold: on 2
    EPYC cores 1-3 ms a batch under 2K tokens by the median, more and noisier above (twelve fleets'
    pilots and runs), 12 % of a batch under 512 tokens and 3 % of one of 512-1.5K. A pilot
    over a quiet stretch of the trace began half its batches idle, its fleet's runs over the busy one 1 %
    (out of sample; `flowprefill` on one worker): a speed per size taken from all of them was 3-7 % slow
    for the runs, and the plan 6-8 points pessimistic per class, at the runs' own speed within 1."""
    busy: dict[int, list[float]] = {}
    idle: list[tuple[int, MeasuredBatch]] = []
    for worker in workers:
        for b, was_idle in zip(worker, begun_idle(worker), strict=True):
            if not sized(b):
                continue
            if was_idle:
                idle.append((size_class(b.tokens), b))
            else:
                busy.setdefault(size_class(b.tokens), []).append(b.exec_s / b.base_s)
    speed = {k: statistics.median(fs) for k, fs in busy.items() if len(fs) >= IDLE_WAKE_MIN_BATCHES}
    excess = [b.exec_s - b.base_s * speed[k] for k, b in idle if k in speed]
    return max(0.0, statistics.median(excess)) if len(excess) >= IDLE_WAKE_MIN_IDLE else None


def net_of_wake(worker: Sequence[MeasuredBatch], wake_s: float) -> list[MeasuredBatch]:
    """One worker's batches, each begun idle (`begun_idle`) less `wake_s` (at most half of it): its speed
    per size as a busy worker's, which the simulator charges `wake_s` more where it begins idle
    (`SimConfig.idle_wake_s`), as many times as the simulated load leaves it idle."""
    if not wake_s:
        return list(worker)
    return [b._replace(exec_s=max(b.exec_s - wake_s, b.exec_s / 2)) if was_idle else b
            for b, was_idle in zip(worker, begun_idle(worker), strict=True)]


def spread(batches: Iterable[MeasuredBatch]) -> float | None:
    """How far a batch's speed strays from its size's: the standard deviation of the log of its measured
    over calibrated seconds, less its size class's median (`speed_by_size`'s). On 2 EPYC cores through
    `serve`: 0.09-0.14 for one worker, 0.11-0.24 for two on 2 cores (14 pilots each). Charged every
    batch the median of its size, a simulated worker had no slow batch to queue behind: at 16 req/s, two
    FlowPrefill workers' `standard` class read 11 points better than their runs at the runs' own speed
    per size, 2 points with this spread drawn (mean of five draws). None: the logs do not say the
    batches' sizes."""
    logs = [[math.log(f) for f in factors] for factors in factors_by_size(batches) if factors]
    off = [x - statistics.median(xs) for xs in logs for x in xs]
    return statistics.pstdev(off) if len(off) > 1 else None


def relative_speeds(runs: Sequence[Sequence[MeasuredBatch]]) -> list[float] | None:
    """Each run's time per batch against all the runs' pooled: the median over its batches of measured over
    calibrated seconds, each over its size class's median across every run (1.0: as pooled; 2.0: twice as
    slow). The plan runs at the pooled speed; this says how steady the machine was under it: one
    `chunked:2048` worker's nine pilots on a shared Xeon took 0.69-2.01 of it in an hour when the machine
    ran at two speeds, 0.72-1.14 in another. None: fewer than two runs, or logs without the
    batches' sizes."""
    kept = [[b for b in bs if sized(b)] for bs in runs]
    if len(runs) < 2 or not any(kept):
        return None
    medians = _size_medians([b for bs in kept for b in bs])
    return [statistics.median(_off_size(b, medians) for b in bs) for bs in kept if bs]


def _size_medians(batches: Iterable[MeasuredBatch]) -> list[float]:
    """Per size class, the median of the batches' measured over calibrated seconds (1.0: none of that size)."""
    return [statistics.median(f) if f else 1.0 for f in factors_by_size(batches)]


def _off_size(b: MeasuredBatch, medians: list[float]) -> float:
    """A batch's measured over calibrated seconds, over its size class's median (`_size_medians`)."""
    return b.exec_s / b.base_s / medians[size_class(b.tokens or 0)]


class Wander(NamedTuple):
    """How a worker's speed strays from its size's within a run: each batch's own lognormal sigma
    (`batch`), and a slow wander of sigma `drift` that forgets itself over `drift_s` seconds
    (engine/sim/errors.py's Drift). On a Xeon's 2 shared cores, of the 0.19-0.21 sigma of a batch's
    log speed about half was still there between batches 0.3 s apart and little 4 s apart (nine runs of
    four fleets): a stretch of slow batches queues requests where as many slow batches
    scattered do not, and a fast stretch drains them."""

    batch: float
    drift: float = 0.0
    drift_s: float = 0.0


# Lags (seconds) the semivariance of a worker's speed is read at; pairs further apart say nothing of a
# drift that forgets itself within a few seconds
LAG_EDGES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
DRIFT_SHARES = [k / 20 for k in range(21)]
DRIFT_TIMES_S = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def wander(batches: Sequence[MeasuredBatch]) -> Wander | None:
    """`Wander` fitted to batch logs (one or more workers' runs, each in the order it logged): the log of
    each batch's speed less its size's median and less its own run's mean (a run's level is the
    machine's mood that day, which the speed per size already holds), and the semivariance of those
    between the batches of one run by their distance in time, 1 - share * exp(-lag / drift_s) of the
    variance, fitted over a grid by least squares. None: the logs do not say sizes and times."""
    medians = _size_medians(batches)
    logs = [[(b.began_at, math.log(_off_size(b, medians))) for b in run] for run in _runs(batches)]
    series = [[(t, x - statistics.fmean(x for _, x in run)) for t, x in run] for run in logs if len(run) > 1]
    residuals = [x for run in series for _, x in run]
    if len(residuals) < 10:
        return None
    variance = statistics.pvariance(residuals)
    bins = _semivariance(series)
    if variance <= 0 or not bins:
        return Wander(math.sqrt(max(variance, 0.0)))

    def misfit(share: float, tau_s: float) -> float:
        return sum(math.sqrt(n) * (g / variance - 1 + share * math.exp(-lag / tau_s)) ** 2 for lag, g, n in bins)

    share, tau_s = min(((s, t) for s in DRIFT_SHARES for t in DRIFT_TIMES_S), key=lambda st: misfit(*st))
    return Wander(math.sqrt(variance * (1 - share)), math.sqrt(variance * share), tau_s if share else 0.0)


def as_wander(noise: Wander | float | None) -> Wander:
    """A `Wander` as given, or one sigma for each batch's own draw (None: none)."""
    return noise if isinstance(noise, Wander) else Wander(noise or 0.0)


def strays(measured: dict[str, Any]) -> Wander:
    """How a pilot's speed strayed, as `at_measured_speed` said it: its `Wander`, else its `spread`."""
    fitted = measured.get("wander")
    return Wander(**fitted) if fitted else as_wander(measured.get("spread"))


def planned_at(cost: OpCost, measured: dict[str, Any]) -> Planned:
    """`cost` (at the speed of a pilot's logs, or an engine pass) as they strayed (`strays`), nothing else
    measured: no time outside the worker, the cost's own host time per batch."""
    fitted = strays(measured)
    return Planned(cost, noise=fitted.batch, drift=fitted.drift, drift_s=fitted.drift_s)


def _runs(batches: Sequence[MeasuredBatch]) -> list[list[MeasuredBatch]]:
    """Batches as logged (`read`: a worker's file after another), cut into their workers' runs: where
    the time goes back (another worker's file) or jumps on by more than the lags read."""
    runs: list[list[MeasuredBatch]] = []
    last = -math.inf
    for b in batches:
        if not (sized(b) and b.began_at is not None):
            continue
        if not runs or not last <= b.began_at <= last + LAG_EDGES[-1]:
            runs.append([])
        runs[-1].append(b)
        last = b.began_at
    return runs


def _semivariance(runs: list[list[tuple[float, float]]]) -> list[tuple[float, float, int]]:
    """Per lag bin (`LAG_EDGES`) with pairs: their mean lag, half their mean squared difference, their count."""
    sums = [[0.0, 0.0, 0] for _ in LAG_EDGES[1:]]
    for run in runs:
        for i, (t, x) in enumerate(run):
            for u, y in run[i + 1:]:
                k = bisect.bisect_right(LAG_EDGES, u - t) - 1
                if k >= len(sums):
                    break
                sums[k][0] += u - t
                sums[k][1] += (x - y) ** 2 / 2
                sums[k][2] += 1
    return [(lag / n, g / n, n) for lag, g, n in sums if n]
