"""Load profiles: what arrives when. Every profile becomes one open-loop schedule (a Workload whose
arrival times are fixed in advance), so the load never waits for responses: closed-loop load hides
head-of-line blocking.

A profile is a built-in name (`steady`, `ramp`, `burst`, `azure`) or a TOML file:

    kind = "trace"            # poisson | ramp | burst | trace
    trace = "azure-mix"       # azure-mix, long-mix, or a trace file (Azure / BurstGPT CSV, Mooncake JSONL)
    window_start_s = 0
    window_s = 300
    rate = 2.0                # replay at this mean rate (req/s); omit for the trace's own pace
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from engine.protocol.slo import DEFAULT_CLASSES
from loadtest.workload import (
    NAMED,
    ClassRule,
    TraceError,
    TraceRequest,
    Workload,
    head,
    named_or_trace,
    poisson,
    scale_to_rate,
    window,
)


class ProfileError(ValueError):
    """A profile that cannot run, with a message that says which field and why."""


class Profile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["poisson", "ramp", "burst", "trace"]
    name: str = ""
    seed: int = 0
    max_tokens: int = 8  # output tokens per request (the trace's own count when smaller)
    endpoint: Literal["completions", "chat"] = "completions"
    requests: int | None = None  # cap on the number of requests
    # Every prompt starts with one of `shared_prefixes` prompts of `shared_prefix_tokens` tokens (a
    # system prompt, a document): load for prefix caching and the gateway's prefix affinity. 0: none.
    shared_prefix_tokens: int = 0
    shared_prefixes: int = 1
    # poisson: `rate` req/s for `duration_s`, prompt sizes drawn from `lengths`
    rate: float | None = None
    duration_s: float = 60.0
    lengths: str = "azure-mix"  # azure-mix, long-mix, a trace file, or "mix" (50/50 short / long)
    # ramp: Poisson steps at each of `rates`, `step_s` each; reported per step to find the knee
    rates: list[float] = []
    step_s: float = 30.0
    # burst: a backlog of long batch requests, then an interactive spike over it (these defaults: the
    # tiny model's sizes). Each backlog request
    # is feasible alone with room to spare: a 3,000-token prefill of the embedded model is predicted
    # at 0.3-0.4 s on a 2-core machine, so a machine 8x slower (or busier) still sends it rather than
    # shedding it as a predicted miss of batch's 6 s target (at 8,000 tokens, 2 s predicted, a busy
    # machine's learned correction did shed them all). Ten of them are some 4 s of prefill there, so
    # the spike, 0.5 s in, lands on them on a faster machine too.
    backlog_requests: int = 10
    backlog_tokens: int = 3000
    backlog_class: str = "batch"
    burst_at_s: float = 0.5
    burst_requests: int = 30
    burst_rate: float = 10.0
    burst_tokens: int = 200
    burst_class: str = "interactive"
    # trace: replay a production trace (rate-scaled, windowed)
    trace: str = "azure-mix"
    window_start_s: float = 0.0
    window_s: float | None = None

    def check(self) -> None:
        def bad(field: str, why: str) -> ProfileError:
            return ProfileError(f"profile {self.name or self.kind!r}: {field} {why}")

        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise bad("requests", "must be >= 1")
        if self.shared_prefix_tokens < 0 or self.shared_prefixes < 1:
            raise bad("shared_prefix_tokens/shared_prefixes", "must be >= 0 / >= 1")
        if self.rate is not None and self.rate <= 0:
            raise bad("rate", "must be > 0 req/s")
        if self.kind == "poisson" and self.rate is None:
            raise bad("rate", "is required for a poisson profile")
        if self.duration_s <= 0:
            raise bad("duration_s", "must be > 0")
        if self.kind == "ramp":
            if not self.rates or any(r <= 0 for r in self.rates):
                raise bad("rates", "must list rates > 0 for a ramp, e.g. rates = [1, 2, 4]")
            if self.step_s <= 0:
                raise bad("step_s", "must be > 0")
        if self.kind == "burst":
            for f in ("backlog_requests", "backlog_tokens", "burst_requests", "burst_tokens"):
                if getattr(self, f) < 1:
                    raise bad(f, "must be >= 1")
            if self.burst_rate <= 0 or self.burst_at_s < 0:
                raise bad("burst_rate/burst_at_s", "must be > 0 / >= 0")
            for f in ("backlog_class", "burst_class"):
                if getattr(self, f) not in DEFAULT_CLASSES:
                    raise bad(f, f"names unknown SLO class {getattr(self, f)!r}; known: {sorted(DEFAULT_CLASSES)}")
        if self.window_s is not None and self.window_s <= 0:
            raise bad("window_s", "must be > 0")
        if self.window_start_s < 0:
            raise bad("window_start_s", "must be >= 0")
        used = "trace" if self.kind == "trace" else "lengths" if self.kind in ("poisson", "ramp") else None
        if used and getattr(self, used) not in (*NAMED, "mix") and not Path(getattr(self, used)).is_file():
            raise bad(used, f"{getattr(self, used)!r} is not {', '.join(NAMED)} or an existing trace file")

    def schedule(self) -> Schedule:
        """The open-loop arrival schedule. Deterministic: every Locust process builds the same one."""
        rule = ClassRule()
        phases: list[float] | None = None
        if self.kind == "poisson":
            assert self.rate is not None
            w = poisson(self.rate, max(1, round(self.rate * self.duration_s)), self._lengths(rule), self.seed, rule)
        elif self.kind == "ramp":
            reqs, phases, t0 = [], [], 0.0
            for i, rate in enumerate(self.rates):
                step = poisson(rate, max(1, round(rate * self.step_s)), self._lengths(rule), self.seed + i, rule)
                reqs += [msgspec.structs.replace(r, arrival_s=t0 + r.arrival_s) for r in step.requests]
                phases += [rate] * len(step.requests)
                t0 += self.step_s
            w = Workload(f"ramp-{'-'.join(f'{r:g}' for r in self.rates)}", step.source, rule.describe(), reqs)
        elif self.kind == "burst":
            reqs = [TraceRequest(0.0, self.backlog_tokens, self.max_tokens, self.backlog_class)
                    for _ in range(self.backlog_requests)]
            reqs += [TraceRequest(self.burst_at_s + i / self.burst_rate, self.burst_tokens, self.max_tokens,
                                  self.burst_class) for i in range(self.burst_requests)]
            w = Workload("burst", "synthetic", f"backlog -> {self.backlog_class}, spike -> {self.burst_class}", reqs)
        else:
            w = self._trace(rule)
            if self.window_s is not None or self.window_start_s:
                try:
                    w = window(w, self.window_start_s, self.window_s or float("inf"))
                except TraceError as exc:
                    raise ProfileError(f"profile {self.name!r}: {exc}") from None
            if self.requests:
                w = head(w, self.requests)
            if self.rate is not None:
                w = scale_to_rate(w, self.rate)
        if self.requests and len(w.requests) > self.requests:
            w = head(w, self.requests)
            phases = phases[: self.requests] if phases else None
        return Schedule(w, phases or [w.rate] * len(w.requests))

    def _lengths(self, rule: ClassRule) -> Workload | None:
        if self.lengths == "mix":
            return None
        return named_or_trace(self.lengths, rule)

    def _trace(self, rule: ClassRule) -> Workload:
        try:
            return named_or_trace(self.trace, rule)
        except (TraceError, OSError) as exc:
            raise ProfileError(f"profile {self.name!r}: {exc}") from None


class Schedule(msgspec.Struct):
    """Arrivals in order; `phase[i]` is the offered rate request i belongs to (one report point each)."""

    workload: Workload
    phase: list[float]

    def __len__(self) -> int:
        return len(self.workload.requests)


BUILTIN: dict[str, Profile] = {
    "steady": Profile(kind="poisson", name="steady", rate=2.0, duration_s=60),
    "ramp": Profile(kind="ramp", name="ramp", rates=[1, 2, 4, 8], step_s=30),
    # Sized for the default model (SmolLM2-135M on a CPU core: about 275 prompt tokens/s, and a decode step
    # of some 60 ms, which a prefill cannot preempt): four 800-token batch prompts (some 3 s each: the
    # first meet batch's 6 s, the rest are served late, within its 18 s bound), then ten interactive
    # 24-token prompts (about 0.1 s each) at 1 req/s, four tokens each.
    "burst": Profile(kind="burst", name="burst", max_tokens=4, backlog_requests=4, backlog_tokens=800,
                     burst_at_s=1.0, burst_requests=10, burst_rate=1.0, burst_tokens=24),
    "burst-tiny": Profile(kind="burst", name="burst-tiny"),  # the embedded tiny model (`serve --model tiny`)
    "azure": Profile(kind="trace", name="azure", trace="azure-mix", requests=200),
}


def load_profile(spec: str, **overrides: object) -> Profile:
    """A built-in profile name or a TOML file; `overrides` (non-None) replace its fields."""
    if spec in BUILTIN:
        profile = BUILTIN[spec]
    else:
        path = Path(spec)
        if not path.is_file():
            raise ProfileError(f"profile {spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file")
        try:  # TOML, or JSON (what `flowprefill loadtest` hands its Locust processes)
            raw = msgspec.json.decode(path.read_bytes()) if path.suffix == ".json" else tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, msgspec.DecodeError) as exc:
            kind = "JSON" if path.suffix == ".json" else "TOML"
            raise ProfileError(f"profile {path}: not valid {kind}: {exc}") from None
        raw.setdefault("name", path.stem)
        try:
            profile = msgspec.convert(raw, Profile)
        except msgspec.ValidationError as exc:
            hint = " (kind: poisson, ramp, burst or trace)" if "$.kind" in str(exc) else ""
            raise ProfileError(f"profile {path}: {exc}{hint}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    if changes:
        try:
            profile = msgspec.convert(msgspec.to_builtins(profile) | changes, Profile)
        except msgspec.ValidationError as exc:
            raise ProfileError(f"profile {spec!r}: {exc}") from None
    profile.check()
    return profile
