"""The one request type that flows from gateway to worker to scheduler to telemetry."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import msgspec

from engine.slo import DEFAULT_CLASSES, SLOClass
from engine.structured_output import Guide


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


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs (and vLLM's default)


class SamplingParams(msgspec.Struct):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    # OpenAI's penalties on tokens already generated, and vLLM's (HF's) on tokens of prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None  # None: off; n: the sampled token's log-probability and the n likeliest
    # vLLM's extensions: min_p keeps tokens at least this share of the likeliest's probability; no
    # stop (EOS, stop_token_ids, stop strings) before min_tokens; stop_token_ids end the answer like
    # EOS, their text kept; include_stop_str_in_output keeps the stop string that ended it.
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    guide: Guide | None = None  # structured output: what the answer must match
    # The prompt tokens' log-probabilities and this many likeliest tokens' (completions' echo with
    # logprobs): the prefill computes its last layer and the logits for every prompt position.
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        if self.max_tokens < 0:  # 0: the prefill only (a prompt scored or echoed, nothing generated)
            raise ValueError("max_tokens must be >= 1")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # torch's generator's range
            raise ValueError("seed must be in [-2**63, 2**64)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.01 <= self.repetition_penalty <= 100:  # dividing by less overflows float32 logits
            raise ValueError("repetition_penalty must be in [0.01, 100]")
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for k in (self.logprobs, self.prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"the number of top logprobs must be in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def penalized(self) -> bool:
        """Whether any bias or penalty changes the logits before sampling."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's threshold too) logits / temperature overflows float32 into inf and NaN.
        return self.temperature < 1e-5 or self.top_k == 1


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
    # (the scheduler's late tier, engine/scheduler/slack.py), or, shed_late, ended while still queued.
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
    prefill_start: float | None = None  # first time its batch ran
    first_token_time: float | None = None
    finish_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    segments: list[tuple[float, float]] = []  # execution intervals of its prefill
    evictions: int = 0  # times its answer's KV was taken back while it decoded (then recomputed)
    suspensions: list[Suspension] = []
    sink: Callable[[TokenOutput], None] | None = None  # called from the engine thread
    # Prefill/decode disaggregation: a prefill worker keeps the prompt's KV when the first token is
    # out (`kv_export`, filled on the engine thread) for hand-off to a decode worker.
    export_kv: bool = False
    kv_export: dict[str, Any] | None = None
    prefilled_elsewhere: bool = False  # a decode worker's: its prompt's KV was handed to it
    choice: int = 0  # OpenAI's n: which choice of its HTTP request this is (metrics count choice 0 once)
    trace_context: Any = None  # telemetry's carrier, never read by the engine
    prompt_token_mask: Any = None  # repetition_penalty's: which vocabulary ids the prompt holds (made once)
    # Structured output: the llguidance matcher its answer follows (engine/structured_output.py),
    # compiled by the worker from its guide; the sampler masks what it does not allow next.
    grammar: Any = None
    # A reasoning model's answer that begins in reasoning: the text that closes it (a reasoning
    # parser's, engine/reasoning.py). Its structured output applies only after; None once closed.
    thinking_until: str | None = None
    # An answer that decides at its first token whether it reasons (reasoning.py may_open): the
    # tokens that open its reasoning, allowed beside its structured output's at that token only.
    opens_thinking: list[int] = []
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
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling.max_tokens
