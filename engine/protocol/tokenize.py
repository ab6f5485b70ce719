"""vLLM's `POST /tokenize` and `POST /detokenize` request bodies (served by engine/serving/tokenize_api.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.protocol.openai import ChatMessage


class TokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None  # also each token's text
    add_generation_prompt: bool | None = None  # messages: the template's cue for the answer (default true)
    continue_final_message: bool | None = None  # refused: the template would have to leave the last open
    chat_template: str | None = None  # refused: templates come with the checkpoint
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # messages: the tools the template describes


class DetokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    tokens: list[int]
    model: str | None = None
