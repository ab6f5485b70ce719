"""`flowprefill plan --cost cpu`: the operator profile checked against the engine itself, on the
workload's own prompts, before planning.

The profile times one block of each operator kind on an idle core (engine/predictor.py); the engine's
prefills run slower than that: on 2 AMD EPYC cores, one torch thread, azure-mix's first 200 prompts
through a fresh engine one at a time ran 1.25-1.33x the profile's seconds (2.1x for batches under 128
tokens, where a step's fixed costs dominate; 1.3x from 2K), and 1.14x on a second pass over the same
prompts (a fresh engine meets every shape for the first time, as a fresh `serve` worker does). Real
`serve --workers 1/2` fleets ran 1.23-1.39x. Planned from the profile alone, `plan` was 0-32 points
optimistic per class at one instance's knee (docs/benchmarks.md). So the planner first runs the first
`--engine-pass` prompts of the workload through a fresh engine in this process, one at a time (no
queueing: only the engine's speed is measured, not the schedule), and simulates at the speed it
measured, a factor per batch size (`at_speed`, as `--speed-from` does with a pilot's logs).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

from engine.batch_log import MeasuredBatch
from engine.config import EngineConfig
from engine.model.plan import OpCost
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim.oracle import BatchCostRecorder, ExactCosts, at_speed, speed_by_size
from loadtest.goodput import make_requests
from loadtest.workload import Workload, head

ENGINE_PASS = 100  # prompts: about 4 s on 2 EPYC cores for azure-mix's, and every size class it has


def engine_pass(engine_cfg: EngineConfig, cost: OpCost, w: Workload, n: int, vocab: int,
                on_prompt: Callable[[int], None] = lambda _i: None) -> list[MeasuredBatch]:
    """The workload's first `n` prompts through a fresh engine, one at a time: each batch's seconds
    against what `cost` predicted for it."""
    from engine.engine import Engine, release_memory
    from engine.request import SamplingParams

    engine = Engine(engine_cfg, policy="fcfs", record_profile=False)
    engine.cost = engine.scheduler.cost = copy.deepcopy(cost)  # predicted as the planner will (it corrects its copy)
    recorder = BatchCostRecorder()
    engine.observers.append(recorder)
    try:
        engine.start()
        for i, req in enumerate(make_requests(head(w, n), DEFAULT_CLASSES, 1.0, 0.0, vocab)):
            with contextlib.suppress(ValueError):  # one the engine refuses (longer than its context): serve's 400
                engine.generate([req.prompt_token_ids], SamplingParams(max_tokens=1),
                                request_ids=[f"engine-pass-{i}"], timeout_s=600)
            on_prompt(i)
    finally:
        engine.shutdown()
        del engine
        release_memory()
    return recorder.batches


def at_measured_speed(cost: OpCost, batches: list[MeasuredBatch]) -> tuple[OpCost, dict[str, Any]]:
    """`cost` at the speed these batches ran: a factor per batch size where they say sizes, else the
    median factor of their requests; and what it rests on (for plan.json)."""
    exact = ExactCosts.from_batches(cost, batches)
    return at_speed(cost, batches, exact.default), {"factor": exact.default, "requests": len(exact.factors),
                                                    "by_size": speed_by_size(batches)}
