"""OpenAI's Responses API (`POST /v1/responses`), the request side: its body, and the chat completion
request it is served as. The input (a string, or a list of message, function_call,
function_call_output and reasoning items) and the instructions become chat messages; function tools
become chat tools, `text.format` becomes `response_format`, `max_output_tokens` becomes `max_tokens`,
`reasoning.effort` reaches the chat template as `reasoning_effort` (as vLLM's). Nothing is stored, so
what needs a stored response (`previous_response_id`, `conversation`, `background`) is refused by
name, as is every other field this server does not do (never silently ignored).
engine/serving/responses_api.py writes the response."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.protocol.openai import ChatCompletionRequest, ChatMessage, StructuredOutputs, Unsupported

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` served: the answer's logprobs
# vLLM's sampling extensions on the Responses API, passed to the chat request as they are
VLLM_FIELDS = ("top_k", "min_p", "seed", "stop", "ignore_eos", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "logit_bias", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
               "structured_outputs")


class Refused(Unsupported):
    """A Responses API field this server does not do; its message says why and what to send."""

    def __init__(self, field: str, message: str) -> None:
        ValueError.__init__(self, message)
        self.field = field


class ResponsesRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    input: str | list[dict[str, Any]]
    model: str = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no padding is added here
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # format (text, json_object, json_schema), verbosity
    reasoning: dict[str, Any] | None = None  # effort (to the template), summary (refused)
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None  # given back on the response
    service_tier: str | None = None  # an SLO class's name, as chat's
    store: bool | None = None  # nothing is stored, whatever it says: no later call can read it back
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic
    max_tool_calls: int | None = None  # of built-in tools, of which there are none here
    truncation: str | None = None  # "disabled" only: an input past the context is a 400
    # Refused when set: they need a stored response, or a feature this server does not have
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    context_management: Any = None
    # vLLM's extensions (VLLM_FIELDS), as chat completions take them
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def refused(self) -> Refused | None:
        """The first field set to something this server does not do, or None."""
        stateless = "responses are not stored here: send the whole conversation as input"
        checks = (
            ("previous_response_id", self.previous_response_id is not None, stateless),
            ("conversation", self.conversation is not None, stateless),
            ("background", bool(self.background), "background responses are not supported (nothing is stored "
                                                   "to poll): send it in the foreground, streamed or not"),
            ("prompt", self.prompt is not None, "stored prompt templates are not supported: send the input"),
            ("context_management", self.context_management is not None, "context management is not supported"),
            ("truncation", self.truncation not in (None, "disabled"),
             'truncation must be "disabled": an input past the context is refused'),
            ("include", any(i != LOGPROBS_INCLUDE for i in self.include or []),
             f"include may only ask for {LOGPROBS_INCLUDE!r}"),
            ("reasoning.summary", bool(self.reasoning) and any(
                (self.reasoning or {}).get(k) is not None for k in ("summary", "generate_summary")),
             "reasoning summaries are not written here; with a reasoning parser the reasoning comes whole"),
            ("text.verbosity", (self.text or {}).get("verbosity") not in (None, "medium"),
             "text.verbosity is not supported"),
        )
        return next((Refused(field, message) for field, bad, message in checks if bad), None)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request this one is served as. Refused or ValueError for what cannot be."""
        if (refused := self.refused()) is not None:
            raise refused
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be >= 1")
        kwargs = dict(self.chat_template_kwargs or {})
        if (effort := (self.reasoning or {}).get("effort")) is not None:
            kwargs["reasoning_effort"] = effort
        logprobs = LOGPROBS_INCLUDE in (self.include or [])
        return ChatCompletionRequest(
            model=self.model, messages=self.messages(), max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream, service_tier=self.service_tier,
            user=self.user, tools=[_chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None,
            tool_choice=_chat_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format((self.text or {}).get("format")),
            logprobs=logprobs or None, top_logprobs=(self.top_logprobs or 0) if logprobs else None,
            chat_template_kwargs=kwargs or None, **{f: getattr(self, f) for f in VLLM_FIELDS})

    def messages(self) -> list[ChatMessage]:
        """The instructions (a system message) and the input, as chat messages."""
        out = [ChatMessage("system", self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, ChatMessage("user", self.input)]
        thought: str | None = None  # a reasoning item's text, for the assistant message after it
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "reasoning":
                thought = "".join(str(p.get("text") or "") for p in item.get("content") or [] if isinstance(p, dict))
            elif kind == "message":
                out.append(ChatMessage(str(item.get("role")), _text(item.get("content"), f"input[{i}].content"),
                                       reasoning_content=thought if item.get("role") == "assistant" else None))
                thought = None if item.get("role") == "assistant" else thought
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", i), "type": "function",
                        "function": {"name": _string(item, "name", i), "arguments": item.get("arguments") or "{}"}}
                if out and out[-1].role == "assistant" and thought is None:  # calls of the same answer
                    out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
                else:
                    out.append(ChatMessage("assistant", None, tool_calls=[call], reasoning_content=thought))
                    thought = None
            elif kind == "function_call_output":
                out.append(ChatMessage("tool", _text(item.get("output"), f"input[{i}].output"),
                                       tool_call_id=_string(item, "call_id", i)))
            else:
                raise Refused(f"input[{i}].type", f"input items of type {str(kind)[:64]!r} are not supported (message, "
                                                  "function_call, function_call_output and reasoning are)")
        return out


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"input[{i}] of type {item.get('type')!r} needs a {key}")
    return value


TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text(content: Any, where: str) -> str:
    """A message's content (a string, or text parts) as one string, its parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ValueError(f"{where} must be a string or a list of content parts")
    if kinds := sorted({str(p.get("type")) for p in content} - set(TEXT_PARTS)):
        raise Refused(where, f"only text content is supported, got {', '.join(kinds)}")
    return "\n".join(str(p.get(TEXT_PARTS[p["type"]]) or "") for p in content)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) as chat's."""
    if tool.get("type") != "function":
        raise Refused(f"tools[{i}].type", f"only function tools are served here, not {str(tool.get('type'))[:64]!r}")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise Refused("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}')


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise Refused("text.format", "text.format must be of type text, json_object or json_schema")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), dict):
        raise ValueError("text.format of type json_schema needs a schema")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
