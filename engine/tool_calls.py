"""Tool calls (OpenAI's `tools`): the model writes them as text in its own format, which a parser
reads back into `tool_calls`, as vLLM's `--tool-call-parser` does.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional
  content (Qwen2.5, Qwen3, Hermes and other ChatML models).
- `llama3_json`: the answer is one or more `{"name": ..., "parameters": {...}}` objects separated by
  `;`, after an optional `<|python_tag|>` (Llama 3.1 and 3.2 with JSON tool calling).

A streamed answer's text goes out as content until a tool call may be starting (the text that
could begin one is held back, as a stop string's would be); from there on it is kept, and read
when the answer ends.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

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
            return _overlap(text, "<tool_call>")
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
        return content or None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": name, "arguments": _arguments(args)}}
                                 for name, args in calls]


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


def _overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
