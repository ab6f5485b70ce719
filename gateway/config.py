"""Gateway configuration: SLO classes, API keys, classification rules, workers (TOML)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from engine.slo import DEFAULT_CLASS, DEFAULT_CLASSES, SLOClass


class APIKey(msgspec.Struct, frozen=True):
    default_class: str | None = None
    ceiling: str | None = None  # the highest class this key may run at


class LengthRule(msgspec.Struct, frozen=True):
    """Requests whose prompt has at most `max_prompt_tokens` tokens (estimated) get `slo_class`."""

    max_prompt_tokens: int
    slo_class: str


class GatewayConfig(msgspec.Struct, kw_only=True):
    classes: dict[str, SLOClass] = msgspec.field(default_factory=lambda: dict(DEFAULT_CLASSES))
    default_class: str = DEFAULT_CLASS
    api_keys: dict[str, APIKey] = {}  # none configured: the gateway is open
    rules: list[LengthRule] = []
    workers: list[str] = []
    request_timeout_s: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024

    def check(self) -> None:
        names = set(self.classes)
        wanted = [self.default_class, *(r.slo_class for r in self.rules)]
        for key in self.api_keys.values():
            wanted += [c for c in (key.default_class, key.ceiling) if c]
        for name in wanted:
            if name not in names:
                raise ValueError(f"gateway config names unknown SLO class {name!r} (known: {sorted(names)})")

    @classmethod
    def load(cls, path: str | Path | None, workers: list[str] | None = None) -> GatewayConfig:
        raw = tomllib.loads(Path(path).read_text()) if path else {}
        if "classes" in raw:  # a TOML table per class: [classes.interactive] ttft_ms = 250 ...
            raw["classes"] = {name: {"name": name, **c} for name, c in raw["classes"].items()}
        try:
            cfg = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if workers:
            cfg.workers = workers
        cfg.check()
        return cfg
