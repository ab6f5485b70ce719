"""Pinning the engine's compute to cores (EngineConfig.cpu_cores, engine/core/cpu_affinity.py): the spec,
its refusals, a real worker's threads where they were put, and serve's split of the cores."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import httpx
import pytest
from processes import free_port, start, stop, wait_healthy

from engine.core.config import EngineConfig
from engine.core.cpu_affinity import CorePinning, allowed_cores, parse_cores
from engine.core.engine import Engine
from gateway.cli.common import CommandLineError
from gateway.cli.serve import Cores

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="core pinning is Linux-only")


def test_core_specs() -> None:
    assert parse_cores("1") == [1]
    assert parse_cores("0-3") == [0, 1, 2, 3]
    assert parse_cores("4, 0,2-3") == [0, 2, 3, 4]
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="cpu_cores"):
            parse_cores(bad)


@linux
def test_cores_the_process_may_not_use_are_refused() -> None:
    missing = max(allowed_cores()) + 1
    with pytest.raises(ValueError, match=rf"cores \[{missing}\] are not available to this process"):
        CorePinning(str(missing))
    with pytest.raises(ValueError, match="not available"):
        Engine(EngineConfig(cpu_cores=str(missing)))


def _allowed(pid: int, tid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return set(parse_cores(line.split(":", 1)[1].strip()))
    raise AssertionError("no Cpus_allowed_list")


@linux
@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs two cores")
def test_a_pinned_worker_computes_on_its_core_and_serves_http_on_the_others() -> None:
    cores = sorted(allowed_cores())
    compute, rest = cores[-1], set(cores[:-1])
    port = free_port()
    proc = start("worker", "--model", "tiny", "--port", str(port), "--cpu-cores", str(compute),
                 "--kv-capacity-tokens", "4096")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "pinned", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        threads = {int(t): _allowed(proc.pid, int(t)) for t in os.listdir(f"/proc/{proc.pid}/task")}
        assert threads[proc.pid] == rest  # the main thread serves HTTP, off the compute core
        assert {compute} in threads.values()  # the engine thread (and any torch threads it started)
        cpu = {line.split('"')[1]: float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith("flowprefill_worker_cpu_seconds_total{")}
        assert set(cpu) == {"compute", "serving"} and cpu["compute"] > 0 and cpu["serving"] > 0, cpu
    finally:
        stop(proc)


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**({"device": "cpu", "cpu_cores": None, "workers": 1} | kw))


@linux
def test_serve_gives_each_worker_its_own_cores_and_the_gateway_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert Cores.plan(_args(workers=2), threads=2) == Cores({0}, [{1, 2}, {3, 4}])
    assert Cores.plan(_args(workers=1), threads=2) == Cores({0, 3, 4}, [{1, 2}])
    assert Cores.plan(_args(workers=3), threads=2) is None  # they do not fit: unpinned
    assert Cores.plan(_args(workers=1), threads=5) == Cores({0, 1, 2, 3, 4}, [{0, 1, 2, 3, 4}])  # gateway shares
    assert Cores.plan(_args(workers=2), threads=3) is None
    assert Cores.plan(_args(device="cuda"), threads=1) is None
    assert Cores.plan(_args(workers=2, cpu_cores="1-4"), threads=1) == Cores({0}, [{1, 2}, {3, 4}])
    with pytest.raises(CommandLineError, match="fewer cores than --workers 3"):
        Cores.plan(_args(workers=3, cpu_cores="1-2"), threads=1)
    with pytest.raises(CommandLineError, match="expected core ids"):
        Cores.plan(_args(cpu_cores="one"), threads=1)


def _cpu_ticks(tid: int) -> int:
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # a thread that has ended since it was listed
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


@linux
@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs two cores")
def test_the_compute_team_is_bound_one_thread_per_core_and_torch_computes_on_it() -> None:
    import threading

    import torch

    from engine.core.cpu_affinity import bind_team

    cores = sorted(allowed_cores())[:2]
    seen: dict[str, object] = {}

    def compute() -> None:  # a thread of its own, as the engine loop: its team is its own
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            bound = bind_team(cores, 2)
            seen["where"] = {i: _allowed(os.getpid(), tid) for i, tid in bound.items()}  # while they run
            tasks = [int(t) for t in os.listdir("/proc/self/task")]
            ticks = {t: _cpu_ticks(t) for t in tasks}
            a = torch.randn(768, 768)
            for _ in range(150):
                a @ a
            seen["bound"] = bound
            seen["busy"] = {t for t in tasks if _cpu_ticks(t) - ticks[t] > 5}  # clock ticks: 10 ms each
        finally:
            torch.set_num_threads(before)

    worker = threading.Thread(target=compute)
    worker.start()
    worker.join()
    bound = seen["bound"]
    assert isinstance(bound, dict) and sorted(bound) == [0, 1], bound
    assert seen["where"] == {0: {cores[0]}, 1: {cores[1]}}
    assert seen["busy"] and seen["busy"] <= set(bound.values())  # the matmuls ran on the bound threads only
