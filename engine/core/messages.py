"""What the serving side and the engine thread say to each other. The engine thread owns the scheduler,
the KV cache, the requests and the cost model (engine/core/owner.py); every other thread sends it one of
these messages and reads back what it publishes: each request's outputs through its sink, and an
`EngineSnapshot` of its queue for GET /load and the metrics. (vLLM's EngineCoreRequest/EngineCoreOutputs
and mini-sglang's message/ are the models; in-process, as the engine's compute is in torch's threads.)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.protocol.worker import WorkerLoad

if TYPE_CHECKING:
    import torch

    from engine.core.request import Request, Sampled

ENGINE_STOPPED = "the engine shut down"  # the error of every request still in it when it stops


class Refusal(NamedTuple):
    """Why requests are refused at admission: the dropped reason (x-flowprefill-dropped-reason) and the
    error message, which names the prediction that refused them."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Arrive:
    """New requests (one HTTP request's prompts and choices), queued together or refused together.
    `verdict`, when given, is set on the engine thread to None (queued) or a `Refusal` (never queued;
    admission at the speed observed now, `Engine._admit`); `on_queued` runs on the engine thread just
    before they are queued (a tracer opens their spans)."""

    reqs: tuple[Request, ...]
    sheddable: bool = False
    verdict: Future[Refusal | None] | None = None
    on_queued: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    """End a request (its client left, or a choice of a failed request): its output says "cancelled"."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ImportKV:
    """Decode a request another worker prefilled: its prompt's KV and its first token."""

    req: Request
    kv: dict[str, torch.Tensor]
    first: Sampled


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn` on the engine thread and set `done` to its result (diagnostics and tests that must touch
    engine state, as the owner does)."""

    fn: Callable[[], Any]
    done: Future[Any]


Message = Arrive | Cancel | ImportKV | Call


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's queue as it last published it (after each event, and every PUBLISH_EVERY_S while a
    batch runs): what GET /load, the load report headers and the metrics read, on any thread."""

    load: WorkerLoad  # waiting and decoding counts too
    evicted: int = 0  # answers whose KV was taken back, waiting for their recompute
    suspended: int = 0  # prefill batches formed or preempted, not running
    cached_blocks: int = 0
    corrections: tuple[float, ...] = ()  # the cost model's factor per batch size class (SIZE_CLASSES, then above)
