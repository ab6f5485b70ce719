"""Pinning the engine's compute to CPU cores (EngineConfig.cpu_cores), as vLLM pins its CPU
worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND).

Unpinned, the kernel may move the compute thread between cores, and on a core another busy process
shares it loses its caches at every switch; the HTTP thread of the same worker also competes with it for
its core. So `pin_compute` binds the calling thread (the one that builds the engine: calibration runs on
it) to the cores before torch starts its intra-op threads: every thread it creates afterwards inherits the
binding, the engine loop thread and its OpenMP team included (libgomp gives each thread that opens a
parallel region its own team, created on that thread's first one). `release_caller` then moves the
calling thread, which goes on to serve HTTP, to the process's other cores, if it has any.

Inheriting the set is not enough with two or more threads: each of them may still run on any of the cores,
and every step of a long prefill (thousands per request) opens a parallel region that waits for its slowest
thread. Served on 2 threads, a 2K prefill took 384 ms with the team free to move against 191 ms in-process
(vLLM, which binds thread i to core i, 183 ms). So `bind_team` binds the calling thread's OpenMP team one
thread per core, as vLLM's init_cpu_threads_env does, from Python: it runs one parallel region through
libgomp's own entry point (GOMP_parallel, what `#pragma omp parallel` compiles to) with a callback in
which each team thread binds itself. libgomp keeps a team per thread that opens regions and reuses its
threads in order, so every region that thread opens later (torch's matmuls, our kernels) runs on the same
bound threads. No compiler is needed, so it also works where our own kernels do not build.

A team also lives as long as the thread that opened it, and libgomp counts every team's threads: once they
outnumber the cores it stops spinning between regions and puts each thread to sleep (its "throttled" spin
count), so every region pays a wake-up. The engine's team alone is within the cores; the team of the
thread that loaded and calibrated the model would stay docked beside it. Measured on 2 cores, 2 threads:
an RMSNorm of 2048 x 256 took 105 us on the first team and 300 us on a second one while the first lived,
and a 2K prefill on a started Engine 141-157 ms against 100 ms run on the main thread. So
`on_passing_thread` runs that work on a thread that ends with it, taking its team along.

Linux only (os.sched_setaffinity); elsewhere cpu_cores is an error rather than silently ignored.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("flowprefill.engine")


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

    def bind_threads(self, threads: int) -> None:
        """Bind the calling thread and its OpenMP team of `threads`, one thread per compute core (bind_team)."""
        bind_team(self.cores, threads)

    def release_caller(self) -> None:
        """Move the calling thread to the process's other cores (none left: to all of its cores, which it
        shares with the compute threads)."""
        os.sched_setaffinity(0, (self.before - set(self.cores)) or self.before)


_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded, or None (torch built with another OpenMP or none: nothing to bind)."""
    try:  # RTLD_NOLOAD: only the copy already in the process, never a second runtime
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    gomp.GOMP_parallel.argtypes = [_REGION, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.omp_get_thread_num.restype = ctypes.c_int
    return gomp


def _on_team(threads: int, each: Callable[[int], None]) -> bool:
    """Run each(thread number) on every thread of the calling thread's OpenMP team of `threads` (one
    parallel region through libgomp's entry point); False when torch runs no libgomp here."""
    gomp = _libgomp()
    if gomp is None:
        return False
    region = _REGION(lambda _: each(gomp.omp_get_thread_num()))  # the GIL taken by ctypes; kept alive for the call
    gomp.GOMP_parallel(region, None, threads, 0)
    return True


def bind_team(cores: list[int], threads: int) -> dict[int, int]:
    """Bind the calling thread's OpenMP team of `threads`: thread i (the caller is 0) to cores[i % len(cores)].
    Returns {thread number: native thread id} of the threads bound; empty when torch runs no libgomp here."""
    if not cores:
        return {}
    bound: dict[int, int] = {}
    errors: list[OSError] = []

    def each(i: int) -> None:
        try:
            os.sched_setaffinity(0, {cores[i % len(cores)]})  # 0: the calling thread, not the process
            bound[i] = threading.get_native_id()
        except OSError as exc:
            errors.append(exc)

    _on_team(threads, each)
    if errors:
        log.warning("binding the compute threads to cores %s failed (%s): they may move between them", cores,
                    errors[0])
    return bound


def team_ids(threads: int) -> set[int]:
    """Native ids of the calling thread and of its OpenMP team of `threads`: the threads its torch
    operators and our kernels compute on (the caller's alone without libgomp)."""
    ids = {threading.get_native_id()}
    _on_team(threads, lambda _: ids.add(threading.get_native_id()))
    return ids


def on_passing_thread(work: Callable[[], None]) -> None:
    """Run `work` on a thread of its own and wait for it (its exception raised here): the OpenMP team it
    opens ends with that thread, so the engine thread's team is the only one left."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # raised again on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="flowprefill-build")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
