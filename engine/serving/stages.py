"""One OpenAI request's stages in the serving layer: its prompts and sampling before any engine work
(`Prepared`), and, once queued, what formats its outputs (`Started`, with the KV a prefill half hands on,
`HeldKV`). The engine's `Request` carries nothing of the serving layer's."""

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
class HeldKV:
    """The prefill half of a disaggregated request: its prompt's KV, from the engine's `Request.kv_sink`
    until the worker hands it on."""

    kv: dict[str, Any] | None = None

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
    held: HeldKV | None = None  # and its KV until then

    @property
    def first(self) -> EngineRequest:
        return self.choices.reqs[0]
