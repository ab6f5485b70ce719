"""Shared fixtures. Nothing here imports the engine (torch) at collection: the gateway's own tests
also run where only the base install is (.ci/run), and there only they are collected."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Engine state changed off the engine thread raises (engine/core/owner.py), in every test and every worker or
# serve process a test starts (they inherit the environment). Set before any engine module is imported.
os.environ["FLOWPREFILL_CHECK_OWNER"] = "1"

ENGINE_INSTALLED = importlib.util.find_spec("torch") is not None
GATEWAY_ONLY = "pytestmark = pytest.mark.gateway_only"  # a test module that runs without the engine extra


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """Without the engine extra, the test modules that need it are not collected (they import torch)."""
    if ENGINE_INSTALLED or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return GATEWAY_ONLY not in collection_path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_checkpoint(name) -> directory of the random tiny HF checkpoint checkpoints.VARIANTS[name],
    built once per session. Treat it as read-only: tests that damage a checkpoint build their own."""
    from checkpoints import build_variant

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_variant(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="module")
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread for a module's tiny models: on a shared, busy machine torch's spinning
    worker threads make tiny ops many times slower. Restores the previous setting afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def private_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Operator profiles measured by tests (tiny models, a busy machine) stay out of ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FLOWPREFILL_CACHE", str(tmp_path_factory.mktemp("profile-cache")))
    yield
    mp.undo()
