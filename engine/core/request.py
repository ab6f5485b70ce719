"""The engine core's request: what the worker adds, the scheduler ranks, prefill and decode run and
observers (telemetry) are told of. It holds nothing of the serving layer's own state."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from engine.protocol.sampling import SamplingParams
from engine.protocol.slo import DEFAULT_CLASSES, SLOClass

if TYPE_CHECKING:
    import torch

    from engine.core.sampling import TokenConstraint


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued for prefill
    PREFILLING = "prefilling"  # its batch is the one executing
    SUSPENDED = "suspended"  # its batch was preempted at an operator boundary
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)


class Suspension(msgspec.Struct):
    """One preemption of a request: the interval its batch sat suspended."""

    start: float
    end: float | None = None
    preempted_by: str = ""  # the id of the preempting batch's head request
    by_class: str = ""
    layer: int = -1
    operator: str = ""
    tokens_done: int = 0  # prompt tokens whose current layer work was complete
    stop_latency_s: float = 0.0  # preemption decided -> batch actually stopped
    # On an asynchronous device (CUDA): the steps still queued when the engine acted on the decision,
    # and their predicted time, which the stop waited for (0 on a CPU, where steps are synchronous).
    queued_steps: int = 0
    queued_predicted_s: float = 0.0


class Timeline(msgspec.Struct):
    """When a request's work happened, on the engine's clock: the engine thread writes it, observers
    (telemetry, metrics) and reports (attainment, the simulator's) read it."""

    prefill_start: float | None = None  # first time its batch ran
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    segments: list[tuple[float, float]] = []  # execution intervals of its prefill
    suspensions: list[Suspension] = []
    evictions: int = 0  # times its answer's KV was taken back while it decoded (then recomputed)


class Logprob(msgspec.Struct, array_like=True):
    """A sampled token's log-probability under the model's distribution (its logits before any
    penalty or temperature, as vLLM reports them), with the likeliest tokens' when asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int = 0  # a prompt token's rank among the vocabulary (1: the likeliest); 0: not computed


class Sampled(msgspec.Struct, array_like=True):
    token: int
    logprob: Logprob | None = None  # when the request asked for logprobs


class TokenOutput(msgspec.Struct):
    """What the engine streams back for a request: new token ids/text, or the end."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    logprobs: list[Logprob] | None = None  # one per token id, when the request asked for them


class Request(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    slo_class: str = "standard"
    ttft_target_s: float = DEFAULT_CLASSES["standard"].ttft_ms / 1000
    tbt_target_s: float = DEFAULT_CLASSES["standard"].tbt_ms / 1000
    priority: int = DEFAULT_CLASSES["standard"].priority
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
    deadline: float = 0.0  # absolute monotonic time the first token is due
    # Once it is late (it can no longer meet its deadline): served by deadline + late_s at the latest
    # (the scheduler's late tier, engine/core/scheduler/slack.py), or, shed_late, ended while still queued.
    late_s: float = 2 * DEFAULT_CLASSES["standard"].ttft_ms / 1000
    shed_late: bool = False

    # Engine-side state: owned by the engine thread once the request is added.
    state: RequestState = RequestState.WAITING
    block_table: list[int] = []
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache (chunked prefill progress)
    # Set on arrival when even running it next could not meet the deadline: the gateway sheds such
    # a request if its class is sheddable; the engine still serves it (after the feasible ones).
    predicted_miss: bool = False
    output_token_ids: list[int] = []
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing precedes it)
    prompt_token_logprobs: list[Logprob | None] = []
    finish_reason: str | None = None
    times: Timeline = msgspec.field(default_factory=Timeline)
    sink: Callable[[TokenOutput], None] | None = None  # called from the engine thread
    # Prefill/decode disaggregation: a prefill worker's request gives its prompt's KV to `kv_sink` when
    # its first token is out (on the engine thread, before its blocks can be freed), for hand-off.
    kv_sink: Callable[[dict[str, Any]], None] | None = None
    prefilled_elsewhere: bool = False  # a decode worker's: its prompt's KV was handed to it
    choice: int = 0  # OpenAI's n: which of its prompt's n samples (observers count the prompt by choice 0)
    prompt_token_mask: torch.Tensor | None = None  # repetition_penalty's: the vocabulary ids the prompt holds
    # What its answer must follow token by token (structured output: engine/core/sampling.py's TokenConstraint,
    # the serving layer's GuidedAnswer); the sampler masks what it does not allow next.
    constraint: TokenConstraint | None = None
    # Prefix caching: the content hashes of the prompt's full KV blocks (None: not cacheable, e.g. a
    # handed-off request), and how many leading prompt tokens were found cached at arrival.
    block_hashes: list[bytes] | None = None
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.deadline:
            self.deadline = self.arrival_time + self.ttft_target_s

    @classmethod
    def for_class(cls, slo: SLOClass, **kw: Any) -> Request:
        return cls(
            slo_class=slo.name,
            ttft_target_s=slo.ttft_ms / 1000,
            tbt_target_s=slo.tbt_ms / 1000,
            priority=slo.priority,
            late_s=slo.late_bound_ms / 1000,
            shed_late=slo.late == "shed",
            **kw,
        )

    def check(self, vocab_size: int, context: int, kv_tokens: int) -> None:
        """Raises ValueError, naming the limit, for a request a worker of this vocabulary, context and
        KV cache cannot serve."""
        self.sampling.validate()
        n = self.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if self.max_total_tokens > context:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({self.sampling.max_tokens}) exceeds the "
                             f"model's context of {context} tokens")
        for name, ids in (("", self.prompt_token_ids), ("logit_bias ", self.sampling.logit_bias),
                          ("stop_token_ids ", self.sampling.stop_token_ids)):
            if not all(0 <= t < vocab_size for t in ids):
                raise ValueError(f"{name}token ids must be in [0, {vocab_size})")
        if self.max_total_tokens > kv_tokens:
            raise ValueError(f"request needs {self.max_total_tokens} tokens of KV cache, the worker has {kv_tokens}")

    @property
    def bound(self) -> float:
        """When its first token is due at the latest once it is late: its deadline + its class's late_ms."""
        return self.deadline + self.late_s

    @property
    def latest(self) -> float:
        """When its first token is of use at all: its bound, or its deadline where its class sheds its
        late requests. Admission refuses a request only when it could not be served even by then."""
        return self.deadline if self.shed_late else self.bound

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and answer so far. A prefill computes them all: only the prompt, unless the answer
        was evicted while decoding (its KV blocks taken back) and is now recomputed with its prompt."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids] if self.output_token_ids else self.prompt_token_ids

    @property
    def remaining_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.times.first_token_time is None else self.times.first_token_time - self.arrival_time

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling.max_tokens
