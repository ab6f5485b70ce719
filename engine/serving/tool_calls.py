"""Tool calls (OpenAI's `tools`): the model writes them as text in its own format, which a parser
reads back into `tool_calls`, as vLLM's `--tool-call-parser` does.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional
  content (Qwen2.5, Qwen3, Hermes and other ChatML models).
- `llama3_json`: the answer is one or more `{"name": ..., "parameters": {...}}` objects separated by
  `;`, after an optional `<|python_tag|>` (Llama 3.1 and 3.2 with JSON tool calling).

A streamed answer's text goes out as content until a tool call may be starting (the text that
could begin one is held back, as a stop string's would be); from there on it is kept, and read
when the answer ends.

A forced call (tool_choice "required" or a named function) needs no parser: structured output
constrains the answer to the call (`ForcedCall`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from engine.core.text import prefix_overlap
from engine.protocol.sampling import Guide

PARSERS = ("hermes", "llama3_json")


class ToolCallParser:
    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(PARSERS)}")
        self.name = name

    def start(self, text: str) -> int:
        """Where a tool call begins in the answer so far, or -1."""
        if self.name == "hermes":
            return text.find("<tool_call>")
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", "<|python_tag|>")) else -1

    def undecided(self, text: str) -> int:
        """How many trailing characters could still be the beginning of a tool call."""
        if self.name == "hermes":
            return prefix_overlap(text, "<tool_call>")
        body = text.lstrip()
        return len(text) if not body or "<|python_tag|>".startswith(body) else 0

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's content and its tool calls. Text that does not parse as calls is content."""
        at = self.start(text)
        if at < 0:
            return text, []
        calls = _hermes(text[at:]) if self.name == "hermes" else _llama3(text[at:])
        if calls is None:
            return text, []
        content = text[:at].strip()
        return content or None, _openai_calls(calls)

    finish_reason = "tool_calls"  # of an answer that made calls


class ForcedCall:
    """tool_choice "required" or a named function: the answer is constrained to the call(s), in
    vLLM's way. A named function's answer is its arguments object (finish_reason "stop", as OpenAI's
    and vLLM's); a required call's is a list of `{"name", "parameters"}` objects, one of the tools'
    each (finish_reason "tool_calls"). It reads like a parser: nothing is content, the answer is the
    calls (a "required" answer cut short by max_tokens is content; a named call's arguments are what
    was written, whole or cut short, as vLLM's); streamed, a named call's arguments go out as they
    are written (engine/serving/choices.py), "required" calls whole at the end."""

    def __init__(self, tools: list[Any], tool_choice: Any, parallel: bool = True) -> None:
        """`parallel`: OpenAI's parallel_tool_calls; false, "required" makes exactly one call."""
        functions: dict[str, Any] = {}
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
            if function["name"] in functions:
                raise ValueError(f"two tools are named {function['name']!r}")
            params = function.get("parameters") or {"type": "object"}
            if not isinstance(params, dict):
                raise ValueError(f"the parameters of tool {function['name']!r} must be a JSON schema object")
            functions[function["name"]] = params
        if tool_choice == "required":
            self.name = None
            defs: dict[str, dict[str, Any]] = {}
            items = []
            for name, params in functions.items():
                # references point at the root ("#/$defs/X"): each tool's definitions move there
                params = dict(params)
                for where in ("$defs", "definitions"):
                    for key, value in (params.pop(where, None) or {}).items():
                        if defs.setdefault(where, {}).setdefault(key, value) != value:
                            raise ValueError(f"tools define {key!r} differently (in {where})")
                items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                               "parameters": params},
                              "required": ["name", "parameters"]})
            schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                      "items": {"anyOf": items}, **defs}
        else:
            function = tool_choice.get("function")
            if tool_choice.get("type") != "function" or not isinstance(function, dict):
                raise ValueError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
            self.name = function.get("name")
            if self.name not in functions:
                raise ValueError(f"tool_choice names {self.name!r}, which is not among the tools")
            schema = functions[self.name]
        self.guide = Guide.json(schema)
        self.finish_reason = "stop" if self.name else "tool_calls"

    def start(self, text: str) -> int:
        return 0

    def undecided(self, text: str) -> int:
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.name is not None:  # its arguments as written and streamed (cut short too, as vLLM's)
            return None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": self.name, "arguments": text}}]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        calls = [_call(c, "parameters") for c in value] if isinstance(value, list) else [None]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, _openai_calls(calls)  # type: ignore[arg-type]


def _openai_calls(calls: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": _arguments(args)}} for name, args in calls]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> list[tuple[str, Any]] | None:
    calls = []
    for body in _HERMES.findall(text):
        call = _call(body, "arguments", "parameters")
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _llama3(text: str) -> list[tuple[str, Any]] | None:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call(obj, "parameters", "arguments", required=True)  # else a JSON answer with a "name"
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \t\n;":
            at += 1
    return calls or None


def _call(obj: Any, *keys: str, required: bool = False) -> tuple[str, Any] | None:
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError:
            return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if required and not any(k in obj for k in keys):
        return None
    return obj["name"], next((obj[k] for k in keys if k in obj), {})


def _arguments(args: Any) -> str:
    """OpenAI's `arguments`: JSON text. A model that wrote its arguments as JSON text already is
    taken at its word rather than encoded twice."""
    if isinstance(args, str):
        try:
            json.loads(args)
            return args
        except json.JSONDecodeError:
            pass
    return json.dumps(args, ensure_ascii=False)
