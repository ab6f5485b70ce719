"""A reproducible competing load for the contended scenarios: one busy process per core, pinned
there, spinning `duty` of every `period_ms` and sleeping the rest (what another tenant's batch job or
a noisy neighbour does to a shared CPU host). Started paused, it can be switched on at a set moment
(the step slowdown in the middle of a run); its CPU time says how much it actually took.

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


def spin(duty: float, period_s: float) -> None:
    busy, idle = duty * period_s, (1 - duty) * period_s
    while True:
        end = time.perf_counter() + busy
        while time.perf_counter() < end:
            pass
        if idle > 0:
            time.sleep(idle)


class BusyLoad:
    """One busy process per core in `cores` at `duty` (0 < duty <= 1)."""

    def __init__(self, cores: tuple[int, ...], duty: float, period_ms: float = 10.0) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"busy duty cycle {duty} must be in (0, 1]")
        self.cores, self.duty, self.period_ms = cores, duty, period_ms
        self._procs: list[subprocess.Popen] = []
        self._started = 0.0

    def start(self, paused: bool = False) -> BusyLoad:
        argv = [sys.executable, "-m", "loadtest.peer.busy", "--duty", str(self.duty), "--period-ms",
                str(self.period_ms)]
        for core in self.cores:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=lambda c=core: _pin(c))
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
        """Stop every busy process: how much CPU they took, per core, while switched on."""
        wall = time.monotonic() - self._started if self._started else 0.0
        cpu = 0.0
        for proc in self._procs:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process does not die of SIGTERM until resumed
                proc.terminate()
            _, _, usage = os.wait4(proc.pid, 0)
            cpu += usage.ru_utime + usage.ru_stime
            proc.returncode = -signal.SIGTERM
        self._procs = []
        share = cpu / wall / len(self.cores) if wall > 0 and self.cores else 0.0
        return {"duty": self.duty, "period_ms": self.period_ms, "on_s": round(wall, 3),
                "cpu_share_per_core": round(share, 3)}


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.peer.busy", description=__doc__.split("\n")[0])
    p.add_argument("--duty", type=float, default=0.5)
    p.add_argument("--period-ms", type=float, default=10.0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    spin(args.duty, args.period_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
