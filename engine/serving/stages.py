"""One OpenAI request's stages in the serving layer: its prompts and sampling before any engine work
(`Prepared`), the state each of its engine requests carries for the serving layer (`Served`, the engine's
`Request.serving`, which the engine never reads), and, once queued, what formats its outputs (`Started`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.request import Request as EngineRequest
from engine.core.request import SamplingParams
from engine.serving.choices import Choices
from engine.serving.tool_calls import ForcedCall, ToolCallParser


@dataclass
class Prepared:
    """A request's prompts (token ids, and the text as given) and sampling, before any engine work."""

    prompts: list[tuple[list[int], str | None]]
    sampling: SamplingParams
    calls: ToolCallParser | ForcedCall | None = None  # what reads its tool calls back
    prompt: str | None = None  # a chat request's, as its template wrote it


@dataclass
class Served:
    """The serving layer's state of one engine request (its `Request.serving`; the engine never reads it)."""

    choice: int = 0  # OpenAI's n: which choice of its HTTP request (usage and metrics count a prompt by choice 0)
    kv: dict[str, Any] | None = None  # the prefill half of a disaggregated request: its prompt's KV, to hand off

    def keep_kv(self, kv: dict[str, Any]) -> None:
        """Request.kv_sink (on the engine thread, before the first token's output is queued)."""
        self.kv = kv


@dataclass
class Started:
    """A request whose engine requests are queued (or, handed off, decoding): its outputs to format."""

    rid: str
    choices: Choices
    headers: dict[str, str]
    kv_to: str | None  # the prefill half of a disaggregated request: where its KV goes

    @property
    def first(self) -> EngineRequest:
        return self.choices.reqs[0]
