"""OpenAI-compatible request and response bodies (msgspec), shared by worker and gateway."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from engine.request import SamplingParams

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

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_completion_tokens or self.max_tokens
        params = SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)
        params.validate()
        return params


class CompletionRequest(_Common, kw_only=True, omit_defaults=True):
    prompt: str | list[Any]  # text, token ids, or a one-element list of either


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]


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
                     first: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta if text or first else {}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def completion_body(rid: str, model: str, text: str, finish: str | None, chat: bool,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}
