"""Which SLO class a request runs at (the precedence of docs/reference.md), and the key's ceiling."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from engine.slo import SLOClass
from gateway.config import GatewayConfig


class ClassificationError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def classify(cfg: GatewayConfig, headers: Mapping[str, str], body: Mapping[str, Any],
             api_key: str | None) -> SLOClass:
    """x-slo-class > x-gateway-inference-objective > x-slo-ttft-ms > body service_tier > the API
    key's default > length rules > the default class; then capped at the key's ceiling."""
    key = cfg.api_keys.get(api_key) if api_key else None
    slo = _requested(cfg, headers, body, key)
    if key is not None and key.ceiling is not None:
        ceiling = cfg.classes[key.ceiling]
        if slo.priority > ceiling.priority:  # served at the ceiling, never escalated
            slo = ceiling
    return slo


def _requested(cfg: GatewayConfig, headers: Mapping[str, str], body: Mapping[str, Any], key: Any) -> SLOClass:
    for header in ("x-slo-class", "x-gateway-inference-objective"):
        if name := headers.get(header):
            if name not in cfg.classes:
                raise ClassificationError(f"unknown SLO class {name[:64]!r} in {header}; known: {sorted(cfg.classes)}",
                                          header)
            return cfg.classes[name]
    if ttft := headers.get("x-slo-ttft-ms"):
        try:
            ms = float(ttft)
        except ValueError:
            raise ClassificationError("x-slo-ttft-ms must be a number of milliseconds", "x-slo-ttft-ms") from None
        if not 0 < ms < 3_600_000:
            raise ClassificationError("x-slo-ttft-ms must be in (0, 3600000)", "x-slo-ttft-ms")
        # The tightest class whose target this request still meets gives its priority.
        base = min((c for c in cfg.classes.values() if c.ttft_ms >= ms), key=lambda c: c.ttft_ms,
                   default=max(cfg.classes.values(), key=lambda c: c.ttft_ms))
        return msgspec.structs.replace(base, ttft_ms=ms)
    tier = body.get("service_tier")
    if isinstance(tier, str) and tier in cfg.classes:
        return cfg.classes[tier]
    if key is not None and key.default_class:
        return cfg.classes[key.default_class]
    if cfg.rules:
        n = _estimate_prompt_tokens(body)
        for rule in sorted(cfg.rules, key=lambda r: r.max_prompt_tokens):
            if n <= rule.max_prompt_tokens:
                return cfg.classes[rule.slo_class]
    return cfg.classes[cfg.default_class]


def _estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Token ids are counted; text is estimated at 4 characters a token (no tokenizer here). A batch
    of prompts (completions' list of strings or of token-id lists) counts them all."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(_estimate_prompt_tokens({"prompt": p}) for p in prompt)
    text = prompt if isinstance(prompt, str) else ""
    for m in body.get("messages") or []:
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            text += m["content"]
    return len(text) // 4
