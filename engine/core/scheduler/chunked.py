"""Chunked prefill (Sarathi-Serve / vLLM style, the paper's DistServe-CP baselines).

Prompts are cut into chunks and batches are filled to `chunk_tokens`; the scheduler can switch
requests only when a chunk batch ends, so the chunk size is its preemption granularity. Ranking is
the same S-EDF as FlowPrefill's (the strong baseline), or arrival order with `order="fcfs"`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.scheduler.slack import sedf_key

if TYPE_CHECKING:
    from engine.core.scheduler import Choice, Scheduler


class Chunked:
    def __init__(self, chunk_tokens: int, order: str = "edf") -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk size must be >= 1 token")
        if order not in ("edf", "fcfs"):
            raise ValueError("chunk order must be edf or fcfs")
        self.chunk_tokens, self.order = chunk_tokens, order
        self.ranks_by_slack = order == "edf"
        self.name = f"chunked:{chunk_tokens}" + ("" if order == "edf" else ":fcfs")

    def choose(self, s: Scheduler) -> Choice:
        if s.chosen is not None and s.chosen in s.pool:
            return s.chosen  # a chunk runs to its end
        ordered = list(s.waiting) if self.order == "fcfs" else sorted(s.waiting, key=lambda r: sedf_key(s, r))
        return s.fill_chunks(ordered, self.chunk_tokens) or None
