"""What a benchmark ran on: recorded in every results file, since numbers mean nothing without it."""

from __future__ import annotations

import os
import platform
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": cpu_count(),
        "os_cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
    }
    with suppress(OSError):
        info["loadavg_at_start"] = os.getloadavg()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "count": torch.cuda.device_count(), "memory_gib": props.total_memory / 2**30,
                       "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(0))}
        try:
            import flashinfer

            info["flashinfer_version"] = flashinfer.__version__
        except ImportError:
            info["flashinfer_version"] = None
    try:
        import transformers

        info["transformers_version"] = transformers.__version__
    except ImportError:
        info["transformers_version"] = None
    return info
