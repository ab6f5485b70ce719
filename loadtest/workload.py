"""Workloads: production-trace loaders, SLO class rules, rate scaling, windows, Poisson arrivals,
and prompts synthesized to an exact token count. Shared by the goodput benchmark and Locust."""

from __future__ import annotations

import csv
import functools
import json
import math
import random
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import msgspec

from engine.protocol.slo import DEFAULT_CLASSES


class TraceRequest(msgspec.Struct, frozen=True):
    arrival_s: float  # seconds from the start of the workload
    input_tokens: int
    output_tokens: int
    slo_class: str
    type: str | None = None
    # Mooncake's `hash_ids`: the prompt's blocks of PREFIX_BLOCK_TOKENS tokens, each named by a hash of it
    # and all before it, so two prompts share a prefix exactly as far as their ids agree (empty: unknown)
    prefix: tuple[int, ...] = ()


class Workload(msgspec.Struct):
    name: str
    source: str
    class_rule: str
    requests: list[TraceRequest]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Mean offered rate in requests per second."""
        n = len(self.requests)
        return (n - 1) / self.duration_s if n > 1 and self.duration_s > 0 else 0.0


class ClassRule(msgspec.Struct, frozen=True):
    """Maps a request to an SLO class: by its trace type where present, else by input length."""

    thresholds: list[tuple[int, str]] = msgspec.field(
        default_factory=lambda: [(1024, "interactive"), (2048, "standard"), (4096, "relaxed")])
    longest: str = "batch"
    by_type: dict[str, str] = msgspec.field(
        default_factory=lambda: {"text": "interactive", "image": "standard", "search": "relaxed", "file": "batch"})

    def __call__(self, input_tokens: int, type_: str | None = None) -> str:
        if type_ is not None and type_ in self.by_type:
            return self.by_type[type_]
        for limit, name in self.thresholds:
            if input_tokens <= limit:
                return name
        return self.longest

    def describe(self) -> str:
        steps = ", ".join(f"<= {n} -> {c}" for n, c in self.thresholds)
        types = ", ".join(f"{t} -> {c}" for t, c in self.by_type.items())
        return f"input tokens {steps}, else {self.longest}; by type: {types}"

    def check(self, classes: Iterable[str] = DEFAULT_CLASSES) -> None:
        known = set(classes)
        for name in [c for _, c in self.thresholds] + [self.longest, *self.by_type.values()]:
            if name not in known:
                raise ValueError(f"class rule names unknown SLO class {name!r}")


class TraceError(ValueError):
    pass


PREFIX_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces


# -- loaders -----------------------------------------------------------------------------------
def load_trace(path: str | Path, rule: ClassRule | None = None, fmt: str = "auto") -> Workload:
    """Azure LLM CSV, BurstGPT CSV, or Mooncake / Qwen-Bailian JSONL (format sniffed by default)."""
    path = Path(path)
    rule = rule or ClassRule()
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    if fmt == "auto":
        fmt = "jsonl" if path.suffix in (".jsonl", ".json") else _sniff_csv(path)
    rows = {"azure": _azure_rows, "burstgpt": _burstgpt_rows, "jsonl": _jsonl_rows}.get(fmt)
    if rows is None:
        raise TraceError(f"unknown trace format {fmt!r} (azure, burstgpt, jsonl)")
    raw = sorted(rows(path), key=lambda r: r[0])
    if not raw:
        raise TraceError(f"{path}: no requests in trace")
    t0 = raw[0][0]
    reqs = [TraceRequest(t - t0, n_in, n_out, rule(n_in, typ), typ, *prefix) for t, n_in, n_out, typ, *prefix in raw]
    return Workload(path.stem, str(path), rule.describe(), reqs)


def _sniff_csv(path: Path) -> str:
    with path.open(newline="") as f:
        header = next(csv.reader(f), [])
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(header):
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= set(header):
        return "burstgpt"
    raise TraceError(f"{path}: unrecognised CSV header {header}; expected Azure LLM "
                     "(TIMESTAMP,ContextTokens,GeneratedTokens) or BurstGPT (Timestamp,Request tokens,Response tokens)")


def _int(value: object, what: str, where: str) -> int:
    try:
        n = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {what} {value!r} is not an integer") from None
    if n < 0:
        raise TraceError(f"{where}: {what} {n} is negative")
    return n


def _azure_rows(path: Path) -> Iterable[tuple[float, int, int, str | None]]:
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path}:{i}"
            try:
                t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            except (ValueError, TypeError):
                raise TraceError(f"{where}: bad TIMESTAMP {row.get('TIMESTAMP')!r}") from None
            n_in = _int(row["ContextTokens"], "ContextTokens", where)
            if n_in:
                yield t, n_in, max(1, _int(row["GeneratedTokens"], "GeneratedTokens", where)), None


def _burstgpt_rows(path: Path) -> Iterable[tuple[float, int, int, str | None]]:
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path}:{i}"
            try:
                t = float(row["Timestamp"])
            except (ValueError, TypeError):
                raise TraceError(f"{where}: bad Timestamp {row.get('Timestamp')!r}") from None
            n_in = _int(row["Request tokens"], "Request tokens", where)
            if n_in:  # BurstGPT logs failed requests with 0 tokens
                yield t, n_in, max(1, _int(row["Response tokens"], "Response tokens", where)), None


def _jsonl_rows(path: Path) -> Iterable[tuple[float, int, int, str | None, tuple[int, ...]]]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
            rows.append((float(obj["timestamp"]), _int(obj["input_length"], "input_length", where),
                         max(1, _int(obj["output_length"], "output_length", where)), obj.get("type"),
                         tuple(_int(h, "hash id", where) for h in obj.get("hash_ids") or ())))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, TraceError):
                raise
            raise TraceError(f"{where}: expected JSON with timestamp, input_length, output_length: {exc}") from None
    # Mooncake stamps arrivals in milliseconds, Qwen-Bailian in seconds: tell them apart by span.
    if rows and (max(r[0] for r in rows) - min(r[0] for r in rows)) > 1e5:
        rows = [(t / 1000, *rest) for t, *rest in rows]  # type: ignore[misc]
    return rows


# -- transformations ---------------------------------------------------------------------------
def merge(name: str, *workloads: Workload) -> Workload:
    reqs = sorted((r for w in workloads for r in w.requests), key=lambda r: r.arrival_s)
    return Workload(name, " + ".join(w.source for w in workloads), workloads[0].class_rule, reqs)


def window(w: Workload, start_s: float, duration_s: float) -> Workload:
    reqs = [r for r in w.requests if start_s <= r.arrival_s < start_s + duration_s]
    if not reqs:
        raise TraceError(f"window [{start_s}, {start_s + duration_s}) s of {w.name} holds no requests")
    return _restarted(w, reqs)


def _restarted(w: Workload, reqs: list[TraceRequest]) -> Workload:
    """These of w's requests, its clock started at the first of them."""
    t0 = reqs[0].arrival_s
    return Workload(w.name, w.source, w.class_rule, [msgspec.structs.replace(r, arrival_s=r.arrival_s - t0)
                                                     for r in reqs])


def scale_to_rate(w: Workload, rate: float) -> Workload:
    """Compress or stretch inter-arrival times so the mean offered rate is `rate` req/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    factor = w.rate / rate if w.rate else 1.0
    return Workload(w.name, w.source, w.class_rule,
                    [msgspec.structs.replace(r, arrival_s=r.arrival_s * factor) for r in w.requests])


def head(w: Workload, n: int) -> Workload:
    return Workload(w.name, w.source, w.class_rule, w.requests[:n])


def skip(w: Workload, n: int) -> Workload:
    """The workload without its first n requests, its clock started at the first one left."""
    if n >= len(w.requests):
        raise TraceError(f"{w.name} has {len(w.requests)} requests: none left after skipping {n}")
    return _restarted(w, w.requests[n:])


def poisson(rate: float, n: int, lengths: Workload | None = None, seed: int = 0,
            rule: ClassRule | None = None) -> Workload:
    """n Poisson arrivals at `rate`; request sizes drawn from `lengths` (a trace) or a 50/50 mix."""
    rng = random.Random(seed)
    rule = rule or ClassRule()
    t, reqs = 0.0, []
    for _ in range(n):
        if lengths is not None:
            src = rng.choice(lengths.requests)
            n_in, n_out = src.input_tokens, src.output_tokens
        else:
            n_in, n_out = rng.choice([(rng.randint(64, 1024), 32), (rng.randint(4096, 12000), 16)])
        reqs.append(TraceRequest(t, n_in, n_out, rule(n_in)))
        t += rng.expovariate(rate)
    return Workload(f"poisson-{rate:g}", lengths.source if lengths else "synthetic", rule.describe(), reqs)


def traces_dir() -> Path:
    """The production traces shipped in the package (loadtest/traces, README.md there says what they
    are and their licence), or the folder $FLOWPREFILL_TRACES names."""
    import os
    from importlib import resources

    env = os.environ.get("FLOWPREFILL_TRACES")
    if env:
        return Path(env)
    # A regular (not zipped) install: setuptools installs package data as plain files.
    return Path(str(resources.files("loadtest") / "traces"))


def azure_mix(rule: ClassRule | None = None) -> Workload:
    """The default benchmark workload: Azure 2023 conversation + code traces merged by timestamp."""
    d = traces_dir()
    conv, code = (load_trace(d / f"azure_llm_2023_{k}.csv", rule) for k in ("conv", "code"))
    # Re-align: both traces cover the same hour; load_trace made each start at 0.
    t_conv, t_code = (_first_timestamp(d / f"azure_llm_2023_{k}.csv") for k in ("conv", "code"))
    offset = t_code - t_conv
    code = Workload(code.name, code.source, code.class_rule,
                    [msgspec.structs.replace(r, arrival_s=r.arrival_s + offset) for r in code.requests])
    mixed = merge("azure-mix", conv, code)
    t0 = mixed.requests[0].arrival_s
    mixed.requests = [msgspec.structs.replace(r, arrival_s=r.arrival_s - t0) for r in mixed.requests]
    return mixed


def _first_timestamp(path: Path) -> float:
    return min(t for t, *_ in _azure_rows(path))


MOONCAKE_TRACE = "mooncake_fast25_synthetic_trace.jsonl"
# long-mix's split: above SHORT_MAX tokens (the default rule's `standard` bound, so long prompts are
# `relaxed` or `batch` and short ones `interactive` or `standard`) a prompt is long; long prompts are
# compressed to at most LONG_MAX: the tiny model's bench peer context (16,384) and both servers' KV
# hold that many with room to spare, and on one CPU core in bf16 an 8K prefill already takes seconds.
SHORT_MAX, LONG_MAX = 2048, 8192


def long_mix(rule: ClassRule | None = None, short_max: int = SHORT_MAX, long_max: int = LONG_MAX) -> Workload:
    """Long prompts over short ones: the Mooncake FAST'25 trace's prompts longer than `short_max`
    (their lengths compressed into (short_max, long_max]) merged, each at its own time, with azure-mix's
    prompts of at most `short_max` tokens over the Mooncake trace's 17 minutes. About 30 % of its
    requests are long; its first 80, 59 %."""
    rule = rule or ClassRule()
    moon = load_trace(traces_dir() / MOONCAKE_TRACE, rule)
    longs = [r for r in moon.requests if r.input_tokens > short_max]
    top = max(r.input_tokens for r in longs)
    reqs = [TraceRequest(r.arrival_s, n, r.output_tokens, rule(n))
            for r in longs for n in [compress(r.input_tokens, short_max, long_max, top)]]
    shorts = [r for r in azure_mix(rule).requests if r.input_tokens <= short_max and r.arrival_s <= moon.duration_s]
    source = (f"{MOONCAKE_TRACE} (inputs > {short_max} tokens, log-compressed into ({short_max}, {long_max}], "
              f"no prefix) + azure-mix (inputs <= {short_max}), over the first {moon.duration_s:.0f} s of each")
    return Workload("long-mix", source, rule.describe(), sorted(reqs + shorts, key=lambda r: r.arrival_s))


# mooncake-4k's cut: a 4K prompt is a second or two of the tiny model's prefill on one CPU core.
MOONCAKE_MAX = 4096


def mooncake(rule: ClassRule | None = None, max_tokens: int = MOONCAKE_MAX) -> Workload:
    """The Mooncake FAST'25 trace with each prompt cut to its first `max_tokens` tokens and the hash ids of
    the blocks kept: a cut prompt shares exactly the prefix it shared (unlike long-mix's compression),
    so prefix caching meets the trace's reuse. Classed by the length served."""
    rule = rule or ClassRule()
    moon = load_trace(traces_dir() / MOONCAKE_TRACE, rule)
    reqs = [msgspec.structs.replace(r, input_tokens=n, slo_class=rule(n, r.type),
                                    prefix=r.prefix[:-(-n // PREFIX_BLOCK_TOKENS)])
            for r in moon.requests for n in [min(r.input_tokens, max_tokens)]]
    source = f"{MOONCAKE_TRACE} (each prompt's first {max_tokens} tokens and their blocks' hash ids)"
    return Workload(f"mooncake-{max_tokens // 1024}k", source, rule.describe(), reqs)


def prefixed_prompt(prefix: Sequence[int], n_tokens: int, vocab_size: int, salt: str = "") -> list[int]:
    """Token ids of a prompt whose 512-token blocks are named by `prefix` (a trace's hash ids): the same
    id, the same tokens, so two prompts share exactly the blocks their ids share. `salt`: another run's
    (a server's cache outlives a run: a fresh salt shares nothing with it)."""
    ids = [t for h in prefix for t in _block_tokens(h, vocab_size, salt)][:n_tokens]
    return ids + synthesize_prompt(n_tokens - len(ids), vocab_size, seed=f"{salt}rest-{prefix[-1] if prefix else ''}")


@functools.lru_cache(maxsize=4096)
def _block_tokens(block: int, vocab_size: int, salt: str) -> tuple[int, ...]:
    return tuple(synthesize_prompt(PREFIX_BLOCK_TOKENS, vocab_size, seed=f"{salt}block-{block}"))


def compress(n: int, low: int, high: int, top: int) -> int:
    """n in (low, top] onto (low, high] on a log scale: low * (n / low) ** k with top landing on high,
    so lengths keep their order and relative spread (a Mooncake prompt of 11.6K tokens, its median,
    becomes 3.5K; its 191K longest, 8K). The prompt's hash ids are dropped: they name 512-token blocks
    of the uncompressed prompt."""
    if top <= high:
        return n
    k = math.log(high / low) / math.log(top / low)
    return min(high, max(low + 1, math.ceil(low * (n / low) ** k)))


NAMED = {"azure-mix": azure_mix, "long-mix": long_mix, "mooncake-4k": mooncake}


def named_or_trace(spec: str, rule: ClassRule | None = None) -> Workload:
    """A named workload (azure-mix, long-mix) or a trace file (Azure / BurstGPT CSV, Mooncake /
    Qwen-Bailian JSONL)."""
    build = NAMED.get(spec)
    return build(rule) if build else load_trace(spec, rule)


# -- prompts -----------------------------------------------------------------------------------
def synthesize_prompt(n_tokens: int, vocab_size: int, seed: int | str, reserved: Iterable[int] = ()
                      ) -> list[int]:
    """Token ids of exactly n_tokens (random ordinary tokens: the engine's cost depends on count only)."""
    rng = random.Random(seed)
    banned = set(reserved)
    upper = min(vocab_size, 256) if vocab_size > 256 else vocab_size  # bytes for the byte tokenizer
    ids = []
    while len(ids) < n_tokens:
        t = rng.randrange(32, upper) if upper > 32 else rng.randrange(upper)
        if t not in banned:
            ids.append(t)
    return ids
