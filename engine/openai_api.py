"""OpenAI-compatible request and response bodies (msgspec), shared by worker and gateway."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from engine.request import Logprob, SamplingParams

# Prefill/decode disaggregation (engine/handoff.py): the gateway sends a request's prefill half with
# KV_TO (where the KV goes) and its decode half with KV_ID (which handed-off KV to decode from).
KV_TO_HEADER = "x-flowprefill-kv-to"
KV_ID_HEADER = "x-flowprefill-kv-id"


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str = ""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: str | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    # Known fields of OpenAI's API this server does not implement: refused with a 400 when set, never
    # silently ignored (a client asking for JSON or tool calls must not get plain text as if it were).
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    def top_logprobs_wanted(self) -> int | None:
        return None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        if self.n != 1:
            return "n"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        if (self.tools and self.tool_choice != "none") or self.functions:
            return "tools"
        return None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if (field := self.unsupported()) is not None:
            raise Unsupported(field)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_completion_tokens or self.max_tokens
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        params = SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                repetition_penalty=self.repetition_penalty, logit_bias=bias,
                                logprobs=self.top_logprobs_wanted())
        params.validate()
        return params


class Unsupported(ValueError):
    """A request field this server does not implement; its message names the field and why."""

    MESSAGES = {  # noqa: RUF012
        "n": "only n=1 is supported",
        "response_format": "response_format other than text (JSON mode, JSON schema) is not supported",
        "tools": "tool calling (tools, functions) is not supported; send tool_choice \"none\" or no tools",
        "echo": "echo is not supported",
        "best_of": "best_of other than 1 is not supported",
        "suffix": "suffix (insertion) is not supported",
    }

    def __init__(self, field: str) -> None:
        super().__init__(self.MESSAGES[field])
        self.field = field


class CompletionRequest(_Common, kw_only=True, omit_defaults=True):
    prompt: str | list[Any]  # text, token ids, or a one-element list of either
    logprobs: int | None = None  # the sampled token's and this many likeliest tokens' log-probabilities
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        return super().unsupported() or ("echo" if self.echo else "best_of" if self.best_of not in (None, 1)
                                         else "suffix" if self.suffix else None)


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def http_error_body(status: int, detail: str) -> dict[str, Any]:
    """Litestar's own HTTP errors (no such route, wrong method, body too large, …) in OpenAI's shape."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_exceeded"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return error_body(detail, kind, code=code)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool,
                     first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta if text or first else {}, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def completion_body(rid: str, model: str, text: str, finish: str | None, chat: bool,
                    prompt_tokens: int, completion_tokens: int, logprobs: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


class LogprobFormatter:
    """Logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
    and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`. A token's string is the
    tokenizer's decoding of it alone (a piece of a multi-byte character decodes to U+FFFD, as in vLLM);
    completions' text offsets add up those strings. Keeps the offset across a stream's chunks."""

    def __init__(self, token_text: Callable[[int], str], chat: bool, top: int) -> None:
        self.token_text, self.chat, self.top, self.offset = token_text, chat, top, 0

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def format(self, entries: list[Logprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._entry(e.token_id, e.logprob)
                                | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries] if self.top else None,
                "text_offset": offsets}
