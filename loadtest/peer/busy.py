"""A reproducible competing load for the contended scenarios: one busy process per core, pinned
there, spinning `duty` of every `period_ms` and sleeping the rest (what another tenant's batch job or
a noisy neighbour does to a shared CPU host); or K such processes left to the scheduler over a set of
cores (hogs: unpinned jobs that oversubscribe the host). Started paused, it can be switched on at a
set moment (the step slowdown in the middle of a run); its CPU time says how much it actually took.

    python -m loadtest.peer.busy --duty 0.5 --period-ms 10     # what the benchmark starts
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress


def spin(duty: float, period_s: float, parent: int | None = None) -> None:
    """Busy `duty` of every period; returns once `parent` is no longer this process's parent (the
    benchmark that started it was killed without stopping it: an orphan would load the core for ever)."""
    busy, idle = duty * period_s, (1 - duty) * period_s
    while parent is None or os.getppid() == parent:
        end = time.perf_counter() + busy
        while time.perf_counter() < end:
            pass
        if idle > 0:
            time.sleep(idle)


class BusyLoad:
    """Busy processes at `duty` (0 < duty <= 1): one per core in `cores`, pinned there; or, with
    `hogs` K >= 1, K of them each free to run on any of `cores`."""

    def __init__(self, cores: tuple[int, ...], duty: float, period_ms: float = 10.0, hogs: int = 0) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"busy duty cycle {duty} must be in (0, 1]")
        if hogs < 0:
            raise ValueError(f"{hogs} hogs: expected >= 0")
        self.cores, self.duty, self.period_ms, self.hogs = cores, duty, period_ms, hogs
        self._procs: list[subprocess.Popen] = []
        self._started = 0.0

    def start(self, paused: bool = False) -> BusyLoad:
        argv = [sys.executable, "-m", "loadtest.peer.busy", "--duty", str(self.duty), "--period-ms",
                str(self.period_ms), "--parent", str(os.getpid())]
        # A hog is given every core explicitly: a child inherits its parent's affinity, and the
        # benchmark has pinned itself (the load generator) off the servers' cores by now.
        slots = [set(self.cores)] * self.hogs if self.hogs else [{core} for core in self.cores]
        for allowed in slots:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=lambda a=allowed: _pin(a))
            self._procs.append(proc)
            if paused:
                os.kill(proc.pid, signal.SIGSTOP)  # before it spins: Python's start-up is ~50 ms
        if not paused:
            self._started = time.monotonic()
        return self

    def resume(self) -> None:
        for proc in self._procs:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        self._started = time.monotonic()

    def stop(self) -> dict[str, float]:
        """Stop every busy process: how much CPU they took, per core of `cores` and in all (in cores),
        while switched on."""
        wall = time.monotonic() - self._started if self._started else 0.0
        cpu, n = 0.0, len(self._procs)
        for proc in self._procs:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process does not die of SIGTERM until resumed
                proc.terminate()
            _, _, usage = os.wait4(proc.pid, 0)
            cpu += usage.ru_utime + usage.ru_stime
            proc.returncode = -signal.SIGTERM
        self._procs = []
        taken = cpu / wall if wall > 0 else 0.0
        return {"duty": self.duty, "period_ms": self.period_ms, "on_s": round(wall, 3), "processes": n,
                "cpu_share_per_core": round(taken / len(self.cores), 3) if self.cores else 0.0,
                "cores_taken": round(taken, 3)}


def _pin(cores: set[int]) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.peer.busy", description=__doc__.split("\n")[0])
    p.add_argument("--duty", type=float, default=0.5)
    p.add_argument("--period-ms", type=float, default=10.0)
    p.add_argument("--parent", type=int, default=None, help="exit once this process is no longer the parent")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    spin(args.duty, args.period_ms / 1000, args.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
