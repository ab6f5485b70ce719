"""The engine's telemetry hooks (light: telemetry imports it without torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.prefill import PrefillBatch
    from engine.core.request import Request


class EngineObserver:
    """Telemetry hooks, called on the engine thread with the engine's clock readings. Observers
    watch; they never steer. A segment is one uninterrupted stretch of a batch's execution."""

    def on_segment_start(self, batch: PrefillBatch, now: float) -> None: ...
    def on_segment_end(self, batch: PrefillBatch, now: float) -> None: ...
    def on_preempt(self, victim: PrefillBatch, by: PrefillBatch) -> None:
        """Called once `by` has started its segment, so its spans exist to be linked to."""
    def on_tokens(self, reqs: list[Request], gaps: list[float | None]) -> None:
        """Each of `reqs` got a token; `gaps`: the time since its previous one (None for a first token)."""
    def on_evict(self, req: Request, now: float) -> None:
        """An answer's KV was taken back while it decoded: it queues to be recomputed."""
    def on_finish(self, req: Request) -> None: ...
    def on_shutdown(self) -> None:
        """The engine stopped (its thread has ended): release what the observer holds (files)."""
