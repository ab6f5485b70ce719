"""OpenAI's chat and completions request bodies (msgspec), with what they ask of sampling and structured
output; error bodies and request ids. Shared by the worker, which decodes them, and the gateway, whose
OpenAPI document is written from them (the answers' bodies: engine/serving/choices.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from engine.protocol.sampling import Guide, SamplingParams


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool | None = None  # a last chunk with the usage
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far on every chunk


class _Common(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str = ""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # OpenAI's clients may send null for "not set": None means the default, in every optional field.
    temperature: float | None = None  # 1.0
    top_p: float | None = None  # 1.0
    top_k: int | None = None  # 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None  # 1
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: str | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    min_p: float | None = None  # vLLM's extensions (engine/protocol/sampling.py SamplingParams)
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = None  # refused when true
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs and this many likeliest
    # Structured output (engine/serving/structured_output.py), at most one of: OpenAI's response_format
    # (json_object, json_schema), vLLM's structured_outputs, and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted, and llguidance used whatever it names
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: a forced "required" call is one call
    # Known fields of OpenAI's API this server does not implement: refused with a 400 when set, never
    # silently ignored (a client asking for function calls must not get plain text as if it were).
    functions: list[Any] | None = None
    function_call: Any = None

    def top_logprobs_wanted(self) -> int | None:
        return None

    def tools_wanted(self) -> bool:
        """Whether the model is offered tools to call (tool_choice "none" offers none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def echoes(self) -> bool:
        """Completions' echo (the prompt given back)."""
        return False

    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the answer is constrained to the call."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def unsupported(self, tool_calls: bool = False) -> str | None:
        """The first field set to something this server does not do, or None. `tool_calls`: the
        worker reads tool calls back (a --tool-call-parser), so tools with tool_choice "auto" are
        served; a forced call ("required", a named function) is served by structured output.
        ValueError for a tool_choice that is none of those."""
        if self.tool_choice not in (None, "none", "auto", "required") and not isinstance(self.tool_choice, dict):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        if self.use_beam_search:
            return "use_beam_search"
        if self.response_format and self.response_format.get("type", "text") not in RESPONSE_FORMATS:
            return "response_format"
        if ((self.tools_wanted() and not tool_calls and not self.forces_tool_call()) or self.functions
                or self.function_call not in (None, "none", "auto")):
            return "tools"
        return None

    def guide(self) -> Guide | None:
        """The structured output asked for, whichever way it was spelled, or None. ValueError when
        it is malformed or asked for twice."""
        found: dict[str, Guide] = {}
        json_options: dict[str, Any] = {"whitespace_pattern": self.guided_whitespace_pattern}
        if (so := self.structured_outputs) is not None:
            json_options = {"any_whitespace": not so.disable_any_whitespace,
                            "whitespace_pattern": so.whitespace_pattern or self.guided_whitespace_pattern,
                            "close_objects": so.disable_additional_properties}
            for name, value in (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                if value is not None:
                    found[f"structured_outputs.{name}"] = _guide(name, value, json_options)
            if so.json_object:
                found["structured_outputs.json_object"] = Guide.json({"type": "object"}, **json_options)
        if (rf := self.response_format) and (kind := rf.get("type", "text")) != "text":
            if kind == "json_object":
                found["response_format"] = Guide.json({"type": "object"}, **json_options)
            else:
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or "schema" not in spec:
                    raise ValueError("response_format of type json_schema needs json_schema.schema")
                found["response_format"] = Guide.json(spec["schema"], **json_options)
        for name in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{name}")) is not None:
                found[f"guided_{name}"] = _guide(name, value, json_options)
        if len(found) > 1:
            raise ValueError(f"ask for one structured output at most, got {', '.join(found)}")
        return next(iter(found.values()), None)

    def sampling(self, default_max_tokens: int, tool_calls: bool = False, guide: Guide | None = None) -> SamplingParams:
        """`guide`: a structured output the request implies (a forced tool call), besides its own."""
        if (field := self.unsupported(tool_calls)) is not None:
            raise Unsupported(field)
        if (asked := self.guide()) is not None and guide is not None:
            raise ValueError("a forced tool call cannot be combined with another structured output")
        guide = guide or asked
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None and max_tokens < 1 and not (max_tokens == 0 and self.echoes()):
            raise ValueError("max_tokens must be >= 1 (0 only with echo: the prompt scored, nothing generated)")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        params = SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                temperature=1.0 if self.temperature is None else self.temperature,
                                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                                seed=self.seed, stop=stop, ignore_eos=bool(self.ignore_eos),
                                presence_penalty=self.presence_penalty or 0.0,
                                frequency_penalty=self.frequency_penalty or 0.0,
                                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                                logit_bias=bias,
                                logprobs=self.top_logprobs_wanted(),
                                min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
                                stop_token_ids=list(self.stop_token_ids or []),
                                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                                guide=guide, prompt_logprobs=self.prompt_logprobs)
        params.validate()
        return params


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object)."""

    json: Any = None  # a JSON schema, as an object or as JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens
    disable_additional_properties: bool = False  # JSON: objects that list properties allow no others
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None  # vLLM's choice among its backends: one here, nothing to fall back on


def _guide(kind: str, value: Any, json_options: dict[str, Any]) -> Guide:
    if kind == "json":
        return Guide.json(value, **json_options)
    if kind == "choice":
        return Guide.choice(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {'regular expression' if kind == 'regex' else kind} must be a non-empty string")
    return Guide(kind, value)


class Unsupported(ValueError):
    """A request field this server does not implement; its message names the field and why."""

    MESSAGES = {  # noqa: RUF012
        "n": "only n=1 is supported",
        "response_format": "response_format must be of type text, json_object or json_schema",
        "tools": "tools are served by chat completions: tool_choice \"auto\" on a server started with "
                 "--tool-call-parser, \"required\" or a named function on any; send tool_choice \"none\" "
                 "or no tools otherwise (the legacy functions are not supported)",
        "best_of": "best_of other than 1 is not supported",
        "suffix": "suffix (insertion) is not supported",
        "use_beam_search": "beam search is not supported",
    }

    def __init__(self, field: str) -> None:
        super().__init__(self.MESSAGES[field])
        self.field = field


class CompletionRequest(_Common, kw_only=True, omit_defaults=True):
    prompt: str | list[Any]  # text, token ids, or a list of either (each its own completion)
    logprobs: int | None = None  # the sampled token's and this many likeliest tokens' log-probabilities
    echo: bool | None = None  # the prompt before the completion (with logprobs: its tokens' too)
    best_of: int | None = None
    suffix: str | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def echoes(self) -> bool:
        return bool(self.echo)

    def prompts(self, encode: Callable[[str], list[int]]) -> list[tuple[list[int], str | None]]:
        """The prompt, or each of a list of prompts (OpenAI's batched form), as token ids and the text
        as given (None for token ids): a string, token ids, or a list of either."""
        if isinstance(self.prompt, str) or _token_ids(self.prompt):
            return [_one_prompt(self.prompt, encode)]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if len(self.prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts at once")
        return [_one_prompt(p, encode) for p in self.prompt]

    def unsupported(self, tool_calls: bool = False) -> str | None:
        return super().unsupported() or ("tools" if self.tools or self.tool_choice not in (None, "none")
                                         else "best_of" if self.best_of not in (None, 1)
                                         else "suffix" if self.suffix else None)

    def sampling(self, default_max_tokens: int, tool_calls: bool = False, guide: Guide | None = None) -> SamplingParams:
        params = super().sampling(default_max_tokens, tool_calls, guide)
        if self.echo and self.logprobs is not None:  # the prompt's logprobs, as OpenAI's legacy API gives
            params = msgspec.structs.replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return params


MAX_PROMPTS = 256  # completions' batched prompts: each is its own engine request (n of them with n)


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _one_prompt(prompt: Any, encode: Callable[[str], list[int]]) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        return encode(prompt), prompt
    if _token_ids(prompt):
        return list(prompt), None
    raise ValueError("prompt must be a string, a list of token ids, or a list of either")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning (Qwen3's template reads it)
    reasoning: str | None = None  # vLLM's newer name for it

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: content as one string (text parts joined by
        newlines, as vLLM does; other parts refused, not rendered as text), absent or empty fields
        left out (Llama 3.1's template takes any `tool_calls` key for a call), `developer` as
        `system` (OpenAI's newer name; templates know only the older)."""
        if self.role not in CHAT_ROLES:
            raise ValueError(f"unknown message role {self.role!r} (expected one of {', '.join(CHAT_ROLES)})")
        content = self.content
        if isinstance(content, list):
            kinds = {part.get("type") for part in content} - {"text"}
            if kinds:
                raise ValueError(f"only text content parts are supported, got {sorted(map(str, kinds))}")
            content = "\n".join(str(part.get("text") or "") for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        message |= {k: v for k in ("name", "tool_call_id") if (v := getattr(self, k))}
        if thought := self.reasoning_content or self.reasoning:
            message["reasoning_content"] = thought
        if self.tool_calls:  # templates write arguments out as JSON themselves: give them the object
            message["tool_calls"] = [_arguments_as_object(c) for c in self.tool_calls]
        return message


def _arguments_as_object(call: Any) -> dict[str, Any]:
    """A tool call of the history as templates read it: `function.name`, and `function.arguments`
    as an object (OpenAI's clients send the JSON text)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("a message's tool_calls must each have a function with a name")
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"tool call arguments are not JSON: {args[:100]!r}") from None
    return call | {"function": function | {"arguments": args}}


class ChatCompletionRequest(_Common, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs (e.g. Qwen3's enable_thinking), less what the server itself decides."""
        kwargs = dict(self.chat_template_kwargs or {})
        if taken := sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt"}):
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")
        return kwargs

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    """A request id in OpenAI's forms: "chatcmpl-…", "cmpl-…", and the newer APIs' "resp_…"."""
    return f"{prefix}_{uuid.uuid4().hex}" if prefix == "resp" else f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def http_error_body(status: int, detail: str) -> dict[str, Any]:
    """Litestar's own HTTP errors (no such route, wrong method, body too large, …) in OpenAI's shape."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_exceeded"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return error_body(detail, kind, code=code)
