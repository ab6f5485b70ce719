"""Where a worker's CPU goes (engine/core/thread_cpu.py): its engine's compute threads, found as the OpenMP
team torch computes on, and the rest of the process; and how a load test reports the split."""

from __future__ import annotations

import os
import threading
import time

import pytest

from engine.core.cpu_affinity import allowed_cores, team_ids
from engine.core.thread_cpu import ThreadCPU, readable, thread_cpu_s
from loadtest.server import Counts, ServerCounters

linux = pytest.mark.skipif(not readable(), reason="threads' CPU time is read from Linux's /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds  # CPU time, not wall time: a busy machine only makes it longer
    while time.thread_time() < end:
        pass


def _on_thread(work) -> None:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=work)
    t.start()
    t.join()


@linux
def test_compute_threads_and_the_rest_are_counted_apart_and_an_ended_thread_still_counts() -> None:
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    ids: list[int] = []

    def engine() -> None:
        ids.append(threading.get_native_id())
        ready.set()
        go.wait()
        _spin(0.3)
        done.set()
        time.sleep(0.5)  # still alive when the split is read

    t = threading.Thread(target=engine)
    t.start()
    ready.wait()
    cpu = ThreadCPU(set(ids))
    go.set()
    done.wait()
    compute, serving = cpu.split()
    assert 0.25 <= compute < 0.6 and serving < 0.1, (compute, serving)
    _spin(0.2)  # this thread: serving
    _on_thread(lambda: _spin(0.2))  # a helper that ends, as an idle HTTP worker thread does
    compute2, serving2 = cpu.split()
    t.join()
    assert compute2 - compute < 0.1, (compute, compute2)
    assert serving2 - serving >= 0.3, (serving, serving2)  # the ended helper's CPU included


@linux
@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs two cores")
def test_the_team_is_the_threads_torch_computes_on() -> None:
    import torch

    seen: dict[str, set[int]] = {}

    def compute() -> None:  # a thread of its own, as the engine loop: its team is its own
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            seen["team"] = team_ids(2)
            tasks = [int(t) for t in os.listdir("/proc/self/task")]
            cpu = {t: thread_cpu_s(t) or 0.0 for t in tasks}
            a = torch.randn(768, 768)
            for _ in range(150):
                a @ a
            seen["busy"] = {t for t in tasks if (thread_cpu_s(t) or 0.0) - cpu[t] > 0.05}
        finally:
            torch.set_num_threads(before)

    _on_thread(compute)
    assert len(seen["team"]) == 2, seen
    assert seen["busy"] and seen["busy"] <= seen["team"], seen


def _counters(before: Counts) -> ServerCounters:
    counters = ServerCounters.__new__(ServerCounters)  # no server: the arithmetic alone
    counters.urls, counters.before = [], before
    return counters


def test_a_load_test_reports_the_cpu_the_workers_took_during_the_run() -> None:
    before = Counts({}, {"compute": 10.0, "serving": 1.0})
    assert _counters(before)._cpu(Counts({}, {"compute": 28.0, "serving": 3.0})) == {
        "compute_s": 18.0, "serving_s": 2.0, "serving_share": 0.1}
    assert _counters(before)._cpu(Counts({}, {"compute": 2.0, "serving": 0.5})) is None  # a worker restarted
    assert _counters(before)._cpu(Counts({}, None)) is None  # not a FlowPrefill worker (any more)
    assert _counters(Counts(None, None))._cpu(Counts({}, {"compute": 1.0, "serving": 1.0})) is None
