"""Pinning the engine's compute to CPU cores (EngineConfig.cpu_cores), as vLLM pins its CPU
worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND).

Unpinned, the kernel may move the compute thread between cores, and on a core another busy process
shares it loses its caches at every switch; the HTTP thread of the same worker also competes with it for
its core. So `pin_compute` binds the calling thread (the one that builds the engine: calibration runs on
it) to the cores before torch starts its intra-op threads: every thread it creates afterwards inherits the
binding, the engine loop thread and its OpenMP team included (libgomp gives each thread that opens a
parallel region its own team, created on that thread's first one). `release_caller` then moves the
calling thread, which goes on to serve HTTP, to the process's other cores, if it has any.

Linux only (os.sched_setaffinity); elsewhere cpu_cores is an error rather than silently ignored.
"""

from __future__ import annotations

import os


def parse_cores(spec: str) -> list[int]:
    """'1', '0-3', '0,2,4-5' -> sorted core ids; ValueError on anything else."""
    cores: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu_cores {spec!r}: expected core ids like 1, 0-3 or 0,2") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu_cores {spec!r}: {part!r} is not a range of core ids")
        cores.update(range(first, last + 1))
    return sorted(cores)


def allowed_cores() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


class CorePinning:
    """The compute cores of one engine, and the cores the rest of its process had before."""

    def __init__(self, spec: str) -> None:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("cpu_cores needs Linux (os.sched_setaffinity)")
        self.cores = parse_cores(spec)
        self.before = allowed_cores()
        missing = set(self.cores) - self.before
        if missing:
            raise ValueError(f"cpu_cores {spec!r}: cores {sorted(missing)} are not available to this process "
                             f"(it may run on {sorted(self.before)})")

    def pin_compute(self) -> None:
        """Bind the calling thread, and every thread it starts from now on, to the compute cores."""
        os.sched_setaffinity(0, self.cores)

    def release_caller(self) -> None:
        """Move the calling thread to the process's other cores (none left: it stays where it is)."""
        rest = self.before - set(self.cores)
        if rest:
            os.sched_setaffinity(0, rest)
