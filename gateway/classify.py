"""Which SLO class a request runs at (the precedence of docs/reference.md), and the key's ceiling."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from engine.protocol.slo import (
    TTFT_HEADERS,
    HeaderError,
    SLOClass,
    class_for_ttft,
    class_named,
    named_class,
    target_ms,
    with_tbt_target,
)
from gateway.config import GatewayConfig


class ClassificationError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def classify(cfg: GatewayConfig, headers: Mapping[str, str], body: Mapping[str, Any],
             api_key: str | None) -> SLOClass:
    """x-slo-class > x-llm-d-inference-objective (or x-gateway-inference-objective) >
    x-llm-d-slo-ttft-ms (or x-slo-ttft-ms) > body service_tier > the API key's default > length
    rules > the default class; then capped at the key's ceiling. A class named by a header takes an
    explicit TTFT target sent with it (as a worker does: engine/protocol/slo.py's `requested_slo`).
    x-llm-d-slo-tpot-ms (or x-slo-tpot-ms) sets the TBT target of the class applied (under a ceiling,
    never tighter than the ceiling's)."""
    key = cfg.api_keys.get(api_key) if api_key else None
    try:
        slo = _requested(cfg, headers, body, key)
        ceiling = cfg.classes[key.ceiling] if key is not None and key.ceiling is not None else None
        if ceiling is not None and slo.priority > ceiling.priority:  # served at the ceiling, never escalated
            slo = ceiling
        tbt = with_tbt_target(slo, headers).tbt_ms
    except HeaderError as exc:
        raise ClassificationError(str(exc), exc.param) from None
    if ceiling is not None:
        tbt = max(tbt, ceiling.tbt_ms)
    return slo if tbt == slo.tbt_ms else msgspec.structs.replace(slo, tbt_ms=tbt)


def _requested(cfg: GatewayConfig, headers: Mapping[str, str], body: Mapping[str, Any], key: Any) -> SLOClass:
    ms = target_ms(headers, TTFT_HEADERS)
    if (named := named_class(headers, cfg.classes)) is not None:
        return named if ms is None else msgspec.structs.replace(named, ttft_ms=ms)
    if ms is not None:
        return class_for_ttft(cfg.classes, ms)
    tier = body.get("service_tier")
    if isinstance(tier, str) and (by_tier := class_named(cfg.classes, tier)) is not None:
        return by_tier
    if key is not None and key.default_class:
        return cfg.classes[key.default_class]
    if cfg.rules:
        n = estimate_prompt_tokens(body)
        for rule in sorted(cfg.rules, key=lambda r: r.max_prompt_tokens):
            if n <= rule.max_prompt_tokens:
                return cfg.classes[rule.slo_class]
    return cfg.classes[cfg.default_class]


def as_chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API body (`instructions`, `input`) as chat's messages, for what the gateway reads
    of a prompt (its length, its prefix for affinity): each item's role (or type) and its text."""
    instructions = body.get("instructions")
    messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    for item in given if isinstance(given, list) else []:
        if isinstance(item, dict):
            content = next((item[k] for k in ("content", "output", "arguments") if k in item), "")
            if isinstance(content, list):  # text parts
                content = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
            messages.append({"role": str(item.get("role") or item.get("type")), "content": content})
    return {"messages": messages, "service_tier": body.get("service_tier")}


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Token ids are counted; text is estimated at 4 characters a token (no tokenizer here). A batch
    of prompts (completions' list of strings or of token-id lists) counts them all."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(estimate_prompt_tokens({"prompt": p}) for p in prompt)
    chars = len(prompt) if isinstance(prompt, str) else 0
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):  # text parts
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return chars // 4
