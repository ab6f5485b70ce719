"""Gateway configuration: SLO classes, API keys, classification rules, workers (TOML)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from engine.protocol.slo import DEFAULT_CLASS, DEFAULT_CLASSES, SLOClass


class APIKey(msgspec.Struct, frozen=True):
    default_class: str | None = None
    ceiling: str | None = None  # the highest class this key may run at


class LengthRule(msgspec.Struct, frozen=True):
    """Requests whose prompt has at most `max_prompt_tokens` tokens (estimated) get `slo_class`."""

    max_prompt_tokens: int
    slo_class: str


class Upstream(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the workers are. `flowprefill`: engine workers (they schedule by SLO themselves; the
    gateway routes on their /load). `openai`: unmodified OpenAI-compatible servers (vLLM, SGLang, …)
    that schedule first-come first-served: the gateway holds requests in a slack-ordered queue and lets at
    most `max_concurrency` run on each, so urgent requests overtake, and maps the class to the
    upstream's priority field."""

    kind: Literal["flowprefill", "openai"] = "flowprefill"
    max_concurrency: int = 8  # openai: requests in flight per upstream server
    # openai: prompt tokens in prefill per server (0: count requests only). The server's step budget
    # (vLLM's --max-num-batched-tokens) fills its batch with what is admitted while urgent requests
    # still overtake at the gateway; a longer prompt goes alone. A streamed request gives its tokens
    # back at its first token, one not streamed at its end.
    max_tokens_in_flight: int = 0
    # openai, with a token budget: tokens of it that a long prompt leaves to shorter ones (-1: a quarter
    # of the budget). A prompt longer than budget - reserve counts as budget - reserve, so prompts of up
    # to `reserve` tokens still go in beside it, as they would join its last chunk at the server; charged
    # the whole budget, a long prompt would keep every urgent request at the gateway until its first token,
    # a server step (200-400 ms on a CPU) later than vLLM alone serves them.
    reserve_tokens: int = -1
    max_queue: int = 1024  # openai: requests waiting at the gateway; past it, 503 queue_full
    # openai: what a waiter's slack is. `observed`: its deadline less the time from dispatch to first
    # token the gateway saw for streamed prompts of its size (gateway/late.py `ServiceTimes`); waiters
    # go by that latest start and turn late once it passes. `deadline`: the deadline alone (EDF).
    slack: Literal["observed", "deadline"] = "observed"
    # openai, with a token budget: a waiter may take room that an earlier one, too long for it, cannot
    # use yet, if it is expected back before that one must start (backfilling; gateway/routing.py).
    # False: strict order.
    backfill: bool = True
    priority_field: str = "priority"  # openai: body field for the class's priority ("" = send none)
    priority_order: Literal["lower_first", "higher_first"] = "lower_first"  # vLLM: lower first; SGLang: higher
    health_path: str = "/health"  # openai: what the health check GETs

    def check(self) -> None:
        if self.max_concurrency < 1 or self.max_queue < 0 or self.max_tokens_in_flight < 0:
            raise ValueError("upstream: max_concurrency must be >= 1, max_queue and max_tokens_in_flight >= 0")
        if self.reserve_tokens > 0 and not self.max_tokens_in_flight:
            raise ValueError("upstream: reserve_tokens needs a token budget (max_tokens_in_flight > 0)")
        if not -1 <= self.reserve_tokens < max(1, self.max_tokens_in_flight):
            raise ValueError(f"upstream: reserve_tokens must be -1 (a quarter of the budget) or from 0 to under "
                             f"max_tokens_in_flight ({self.max_tokens_in_flight})")

    @property
    def long_prompt_charge(self) -> int:
        """What a prompt at least this long counts against the token budget (`reserve_tokens`)."""
        reserve = self.max_tokens_in_flight // 4 if self.reserve_tokens < 0 else self.reserve_tokens
        return self.max_tokens_in_flight - reserve


class Discovery(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How `dns:NAME:PORT` workers are found (gateway/discovery.py): NAME's A and AAAA records (a
    headless Service's ready pods), looked up every `interval_s` with `nameservers` on `port` (none:
    the system's resolver, getaddrinfo: /etc/hosts, /etc/resolv.conf and its search domains)."""

    interval_s: float = 5.0  # CoreDNS answers for Kubernetes Services with a 5 s TTL
    nameservers: list[str] = []
    port: int = 53
    timeout_s: float = 2.0  # one lookup's limit; a failed one keeps the members already known

    def check(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or not 1 <= self.port <= 65535:
            raise ValueError("discovery: interval_s and timeout_s must be > 0 and port a TCP port")


class GatewayConfig(msgspec.Struct, kw_only=True):
    classes: dict[str, SLOClass] = msgspec.field(default_factory=lambda: dict(DEFAULT_CLASSES))
    default_class: str = DEFAULT_CLASS
    api_keys: dict[str, APIKey] = {}  # none configured: the gateway is open
    rules: list[LengthRule] = []
    workers: list[str] = []
    prefill_workers: list[str] = []  # set: disaggregated, `workers` decode and these prefill
    request_timeout_s: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024
    upstream: Upstream = Upstream()
    # Prefix affinity (gateway/affinity.py): a request goes to the worker holding its longest earlier
    # prefix of at least this many characters (new: its first characters' rendezvous choice), unless
    # that worker's backlog is past the least loaded one's by more than the slack.
    prefix_affinity_chars: int = 1024
    prefix_affinity_slack_s: float = 0.25
    discovery: Discovery = Discovery()
    # Rank a worker, between polls of its GET /load, by the backlog its last answer reported (ORCA's
    # `endpoint-load-metrics` header, engine/protocol/worker.py); false: by the last poll alone.
    load_reports: bool = True

    def check(self) -> None:
        from gateway.discovery import parse_target

        self.upstream.check()
        self.discovery.check()
        for source in (*self.workers, *self.prefill_workers):
            parse_target(source)  # a malformed dns: entry is the user's to fix, before anything starts
        if self.prefix_affinity_chars < 0 or self.prefix_affinity_slack_s < 0:
            raise ValueError("prefix_affinity_chars and prefix_affinity_slack_s must be >= 0")
        names = set(self.classes)
        folded: dict[str, str] = {}
        for name in sorted(names):  # headers name a class in any case: two that differ only so are one
            if (other := folded.setdefault(name.casefold(), name)) != name:
                raise ValueError(f"SLO classes {other!r} and {name!r} differ only in case (headers name classes "
                                 "in any case)")
        wanted = [self.default_class, *(r.slo_class for r in self.rules)]
        for key in self.api_keys.values():
            wanted += [c for c in (key.default_class, key.ceiling) if c]
        for name in wanted:
            if name not in names:
                raise ValueError(f"gateway config names unknown SLO class {name!r} (known: {sorted(names)})")

    def upstream_priority(self, slo: SLOClass) -> int:
        """The class's priority as the upstream reads it (SLO classes: higher = more urgent)."""
        if self.upstream.priority_order == "higher_first":
            return slo.priority
        return max(c.priority for c in self.classes.values()) - slo.priority

    @classmethod
    def load(cls, path: str | Path | None, workers: list[str] | None = None,
             prefill_workers: list[str] | None = None) -> GatewayConfig:
        raw = tomllib.loads(Path(path).read_text()) if path else {}
        if "classes" in raw:  # [classes.NAME] tables: change a default class's fields, or add a class
            defaults = {n: msgspec.structs.asdict(c) for n, c in DEFAULT_CLASSES.items()}
            raw["classes"] = defaults | {name: defaults.get(name, {}) | c | {"name": name}
                                         for name, c in raw["classes"].items()}
        try:
            cfg = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if workers:
            cfg.workers = workers
        if prefill_workers:
            cfg.prefill_workers = prefill_workers
        cfg.check()
        return cfg
