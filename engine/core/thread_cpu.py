"""Where a worker's CPU goes: its engine's compute threads (the engine loop and its OpenMP team) and the
rest of its process, the serving side (HTTP, tokenizing, JSON, SSE), since the engine loop started.

The engine loop shares its process, and its GIL, with the worker's HTTP side. vLLM runs its engine core
in a process of its own; what that would give this engine is at most the CPU the serving side takes
beside it. Measured (2 cores, the worker on one, 100 azure-mix requests at 1-16 req/s): 2-4 ms a
request with 1 output token, 3.5-8.5 ms with 64 streamed, 4-8 % of the worker's CPU, so the engine
stays in this process; above about 20 % a process of its own would pay.
`flowprefill loadtest` reads the split from each worker's /metrics
(`flowprefill_worker_cpu_seconds_total`) and reports it per run.

Linux only: a thread's CPU time is read from /proc (schedstat's nanoseconds, else stat's clock ticks).
Serving is the process's CPU time (`time.process_time`, which keeps the time of threads that have
ended) less the compute threads' and less what the process had used when the loop started (the model's
load and its calibration), so it never counts down when an idle HTTP helper thread exits.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def thread_cpu_s(native_id: int) -> float | None:
    """CPU seconds a thread of this process has run (None: no such thread, or no /proc)."""
    task = Path(f"/proc/self/task/{native_id}")
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        stat = (task / "stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def readable() -> bool:
    """Whether this platform lets a process read its threads' CPU time (Linux's /proc)."""
    return thread_cpu_s(threading.get_native_id()) is not None


class ThreadCPU:
    """The CPU seconds of a set of compute threads and of the rest of the process, from now on."""

    def __init__(self, compute: set[int]) -> None:
        self.compute = frozenset(compute)
        self._compute_base_s = self._compute_s()
        self._process_base_s = time.process_time()
        self._serving_s = 0.0

    def _compute_s(self) -> float:
        return sum(s for tid in self.compute if (s := thread_cpu_s(tid)) is not None)

    def split(self) -> tuple[float, float]:
        """(compute, serving) CPU seconds since this was made; serving never decreases (the two clocks
        are read one after the other, and a thread's is kept in ticks where schedstat is missing)."""
        compute = self._compute_s() - self._compute_base_s
        serving = time.process_time() - self._process_base_s - compute
        self._serving_s = max(self._serving_s, serving)
        return compute, self._serving_s
