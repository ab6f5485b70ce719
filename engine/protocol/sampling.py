"""Sampling parameters, and the structured output an answer must match (`Guide`): pure data, as the
request bodies (engine/protocol/openai.py) make them and the engine (engine/core/sampling.py) and the
serving layer's matcher (engine/serving/structured_output.py) read them."""

from __future__ import annotations

import json
from typing import Any

import msgspec

KINDS = ("json", "regex", "choice", "grammar")


class Guide(msgspec.Struct, frozen=True, omit_defaults=True):
    """What an answer must match."""

    kind: str  # one of KINDS
    spec: str  # a JSON schema, a regular expression, a JSON list of strings, or a Lark / GBNF grammar
    # JSON: whitespace may be written between tokens (vLLM's default); off, the JSON is compact, which
    # keeps a weak model from padding its answer with whitespace until max_tokens.
    any_whitespace: bool = True
    whitespace_pattern: str | None = None  # JSON: a regular expression for that whitespace instead

    @classmethod
    def json(cls, schema: Any, close_objects: bool = False, **kw: Any) -> Guide:
        """`close_objects` (vLLM's disable_additional_properties): objects that list their
        properties allow no others unless they say so."""
        try:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the JSON schema is not JSON: {exc}") from None
            if schema is True:
                schema = {}  # JSON Schema's "anything"
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return cls("json", json.dumps(_closed(schema) if close_objects else schema), **kw)
        except RecursionError:
            raise ValueError("the JSON schema is nested too deeply") from None

    @classmethod
    def choice(cls, choices: Any) -> Guide:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices))


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


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
