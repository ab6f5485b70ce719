"""What a batch begun on an idle worker costs beyond its size's speed (engine/planner/measured.py's
`idle_wake`): measured from a pilot's batch logs, netted out of its speed per size, and charged back by the
simulator wherever its own load leaves an instance idle."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_sim import COST

from engine.core.batch_log import MeasuredBatch


def _batch(rid: str, began: float, exec_s: float, arrived: float, base_s: float = 0.01) -> MeasuredBatch:
    return MeasuredBatch([rid], base_s, exec_s, 1.0, 100, began + exec_s, began, [arrived])


def test_a_batch_begins_idle_where_its_last_request_came_after_every_earlier_batch_ended() -> None:
    """The first batch, and one whose request arrived after the others had all ended, begin idle; one whose
    request was waiting, or arrived while another batch ran (preempting it), does not; an older log
    without those times is not said idle."""
    from engine.planner.measured import begun_idle

    worker = [_batch("a", 0.0, 0.100, 0.0),
              _batch("c", 0.150, 0.050, 0.149),  # arrived while b ran (b ends at 0.300): busy
              _batch("b", 0.103, 0.197, 0.05),  # waited behind a: busy
              _batch("d", 0.400, 0.010, 0.350),  # arrived after b ended: idle
              MeasuredBatch(["old"], 0.01, 0.02, 1.0, 100)]
    assert begun_idle(worker) == [True, False, False, True, False]


def _worker(idle: int, busy: int = 6, wake_s: float = 0.003) -> list[MeasuredBatch]:
    """`busy` batches back to back at 2x their 10 ms prediction (the first of them begun idle, as a worker's
    first batch is), then `idle` ones each 1 s after the last ended, 2x and `wake_s` more."""
    out, t = [], 0.0
    for i in range(busy):
        out.append(_batch(f"b{i}", t, 0.020, 0.0))
        t += 0.020
    for i in range(idle):
        t += 1.0
        out.append(_batch(f"i{i}", t, 0.020 + wake_s, t))
        t += 0.020 + wake_s
    return out


def test_idle_wake_is_the_median_excess_of_idle_batches_over_busy_ones_of_their_size() -> None:
    from engine.planner.measured import IDLE_WAKE_MIN_IDLE, idle_wake, net_of_wake

    assert idle_wake([_worker(IDLE_WAKE_MIN_IDLE)]) == pytest.approx(0.003)
    assert idle_wake([_worker(IDLE_WAKE_MIN_IDLE - 2)]) is None  # too few to say (with the first one)
    assert idle_wake([_worker(IDLE_WAKE_MIN_IDLE, busy=4)]) is None  # no busy speed to measure them against
    assert idle_wake([_worker(IDLE_WAKE_MIN_IDLE, wake_s=-0.001)]) == 0.0  # faster idle: nothing to charge
    net = net_of_wake(_worker(3), 0.003)  # the idle ones at the busy ones' speed, the busy ones as they were
    assert [b.exec_s for b in net] == pytest.approx([0.017] + [0.020] * 8)  # (the first too: it began idle)
    assert net_of_wake(_worker(1), 0.5)[-1].exec_s == pytest.approx(0.023 / 2)  # at most half of it
    assert net_of_wake(_worker(1), 0.0) == _worker(1)


def test_the_simulator_charges_the_wake_up_to_a_batch_begun_idle_only() -> None:
    """A prefill, a short request that arrives while it runs, and one five seconds later: with 4 ms of
    wake-up the first and the last begin idle and end 4 ms later; the short one waited behind the first
    (4 ms later for it), but its own batch began busy. A fleet's instance charges it too, as planned."""
    from engine.core.config import EngineConfig
    from engine.core.scheduler import make_policy
    from engine.planner.fleet import Planner
    from engine.planner.measured import Planned
    from engine.protocol.slo import DEFAULT_CLASSES
    from engine.sim.simulator import SimConfig, simulate
    from loadtest.goodput import make_requests
    from loadtest.workload import TraceRequest, Workload

    w = Workload("apart", "test", "fixed", [TraceRequest(0.0, 500, 1, "batch"),
                                            TraceRequest(0.001, 50, 1, "interactive"),
                                            TraceRequest(5.0, 50, 1, "relaxed")])

    def ttfts(wake_s: float) -> list[float]:
        reqs = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
        simulate(reqs, make_policy("fcfs"), COST, replace(SimConfig(), idle_wake_s=wake_s))
        return [r.ttft for r in reqs]  # type: ignore[misc]

    assert [a - b for a, b in zip(ttfts(0.004), ttfts(0.0), strict=True)] == pytest.approx([0.004] * 3)
    planner = Planner(w, COST, EngineConfig(prefix_caching=False), 0.9, False)

    def relaxed_ttft(wake_s: float) -> float:
        planner.use(Planned(COST, idle_wake_s=wake_s))
        return planner.evaluate("fcfs", 1, stop_early=False)["per_class"]["relaxed"]["ttft_p50_ms"] / 1000

    assert relaxed_ttft(0.004) - relaxed_ttft(0.0) == pytest.approx(0.004)


def test_a_pilot_s_wake_up_is_planned_with() -> None:
    """A pilot's `idle_wake_ms` (plan.json, per pilot the median of its runs') is the plan's wake-up."""
    from engine.planner.measured import median_overheads, planned_with

    runs = [{"idle_wake_ms": 1.0}, {"idle_wake_ms": 3.0}, {"idle_wake_ms": None}, {"idle_wake_ms": 2.0}]
    assert median_overheads(runs)["idle_wake_ms"] == 2.0
    assert planned_with(COST, median_overheads(runs)).idle_wake_s == pytest.approx(0.002)
    assert planned_with(COST, {}).idle_wake_s == 0.0
