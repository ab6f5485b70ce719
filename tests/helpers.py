"""Helpers shared by the test modules (imported by name, like `checkpoints`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Generator, Iterator
from typing import ClassVar

import pytest
import torch

import engine.core.engine as engine_module
from engine.core.config import EngineConfig
from engine.core.engine import Engine


def drain(gen: Generator[int, None, torch.Tensor]) -> torch.Tensor:
    """Run a prefill generator to the end; its return value (the logits)."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


class EngineFactory:
    """Engines on the embedded model (seed 0), loaded and profiled once per session: later engines
    reuse the weights and a fresh copy of the operator profile as calibrated (the correction one engine
    learned would steer the next test's predictions). One intra-op thread (much faster for this small
    model on shared cores); `close` shuts every engine down and restores the thread count."""

    _shared: ClassVar[dict[str, object]] = {}

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **defaults: object) -> None:
        self.monkeypatch, self.defaults = monkeypatch, {"num_threads": 1, **defaults}
        self.engines: list[Engine] = []
        self._threads = torch.get_num_threads()

    def __call__(self, policy: str = "flowprefill", start: bool = True, **cfg: object) -> Engine:
        shared = self._shared
        if "model" in shared:
            self.monkeypatch.setattr(engine_module, "load_model", lambda c, *_: shared["model"])
            self.monkeypatch.setattr(engine_module, "load_cost", lambda m, record=True: copy.deepcopy(shared["cost"]))
        eng = Engine(EngineConfig(**{**self.defaults, **cfg}), policy)  # type: ignore[arg-type]
        shared.setdefault("model", (eng.model, eng.tokenizer))
        shared.setdefault("cost", copy.deepcopy(eng.cost))  # as calibrated, before this engine corrects it
        self.engines.append(eng)
        return eng.start() if start else eng

    def close(self) -> None:
        for eng in self.engines:
            eng.shutdown()
        torch.set_num_threads(self._threads)


class RerunCapture:
    """CPU stand-in for `cuda_capture`: a replay reruns the captured function; counts replays."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()  # cuda_capture's warm-up run

        def replay() -> None:
            self.replays += 1
            fn()

        return replay


@contextlib.contextmanager
def module_engine(**cfg: object) -> Iterator[Engine]:
    """One started engine on the embedded model, for a module-scoped fixture (EngineFactory's set-up
    and tear-down, with a monkeypatch of its own)."""
    mp = pytest.MonkeyPatch()
    factory = EngineFactory(mp, **cfg)
    try:
        yield factory()
    finally:
        factory.close()
        mp.undo()
