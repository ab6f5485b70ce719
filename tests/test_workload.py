"""Trace loaders, class rules and workload transformations on small fixtures of each format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.workload import (
    ClassRule,
    TraceError,
    load_trace,
    poisson,
    scale_to_rate,
    skip,
    synthesize_prompt,
    traces_dir,
    window,
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_azure_csv(tmp_path: Path) -> None:
    p = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.1805900,3000,10\n"
              "2023-11-16 18:15:46.9805900,9000,5\n")
    w = load_trace(p)
    assert [r.input_tokens for r in w.requests] == [374, 9000, 3000]  # sorted by time
    assert w.requests[0].arrival_s == 0.0
    assert w.requests[1].arrival_s == pytest.approx(0.3)
    assert [r.slo_class for r in w.requests] == ["interactive", "batch", "relaxed"]


def test_burstgpt_csv_skips_failed_requests(tmp_path: Path) -> None:
    p = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "5,ChatGPT,1500,20,1520,Conversation log\n7,ChatGPT,0,0,0,Conversation log\n"
              "9.5,GPT-4,100,3,103,API log\n")
    w = load_trace(p)
    assert [(r.arrival_s, r.input_tokens, r.slo_class) for r in w.requests] == [
        (0.0, 1500, "standard"), (4.5, 100, "interactive")]


def test_mooncake_ms_and_bailian_seconds_with_types(tmp_path: Path) -> None:
    moon = write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in [
        {"timestamp": 0, "input_length": 6000, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 250000, "input_length": 100, "output_length": 5}]))
    w = load_trace(moon)
    assert w.requests[1].arrival_s == pytest.approx(250.0)  # milliseconds
    qwen = write(tmp_path, "q.jsonl", "\n".join(json.dumps(x) for x in [
        {"timestamp": 10.0, "input_length": 6000, "output_length": 10, "type": "text"},
        {"timestamp": 12.5, "input_length": 100, "output_length": 5, "type": "file"}]))
    w = load_trace(qwen)
    assert w.requests[1].arrival_s == pytest.approx(2.5)  # seconds
    assert [r.slo_class for r in w.requests] == ["interactive", "batch"]  # by type, not length


@pytest.mark.parametrize(("name", "text", "msg"), [
    ("x.csv", "a,b,c\n1,2,3\n", "unrecognised CSV header"),
    ("y.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", "bad TIMESTAMP"),
    ("z.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,five,5\n", "not an integer"),
    ("n.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-3,5\n", "negative"),
    ("e.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("j.jsonl", '{"timestamp": 1}\n', "expected JSON with timestamp"),
    ("k.jsonl", "not json\n", "expected JSON"),
])
def test_bad_traces_rejected_clearly(tmp_path: Path, name: str, text: str, msg: str) -> None:
    with pytest.raises(TraceError, match=msg):
        load_trace(write(tmp_path, name, text))


def test_missing_file() -> None:
    with pytest.raises(TraceError, match="does not exist"):
        load_trace("/nonexistent/trace.csv")


def test_class_rule_thresholds_and_check() -> None:
    rule = ClassRule()
    assert [rule(n) for n in (1024, 1025, 2048, 4096, 4097)] == [
        "interactive", "standard", "standard", "relaxed", "batch"]
    rule.check()
    with pytest.raises(ValueError, match="unknown SLO class"):
        ClassRule(longest="bulk").check()


def test_rate_scaling_window_and_poisson() -> None:
    w = poisson(2.0, 400, seed=1)
    assert w.rate == pytest.approx(2.0, rel=0.15)
    assert poisson(2.0, 50, seed=1).requests == poisson(2.0, 50, seed=1).requests  # deterministic
    fast = scale_to_rate(w, 8.0)
    assert fast.rate == pytest.approx(8.0)
    assert [r.input_tokens for r in fast.requests] == [r.input_tokens for r in w.requests]
    part = window(w, 10.0, 20.0)
    assert part.requests[0].arrival_s == 0.0 and part.duration_s < 20.0
    with pytest.raises(TraceError):
        window(w, 1e6, 1.0)
    rest = skip(w, 100)
    assert rest.requests[0].arrival_s == 0.0 and len(rest.requests) == 300
    assert [r.input_tokens for r in rest.requests] == [r.input_tokens for r in w.requests[100:]]
    with pytest.raises(TraceError, match="none left"):
        skip(w, 400)


def test_prompts_synthesized_to_exact_count() -> None:
    for n in (1, 17, 4096):
        ids = synthesize_prompt(n, 512, seed=n, reserved=[256, 258])
        assert len(ids) == n and not {256, 258} & set(ids)


def test_the_traces_ship_in_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A user's clone reads its own copies (never a folder beside the checkout); $FLOWPREFILL_TRACES overrides them."""
    monkeypatch.delenv("FLOWPREFILL_TRACES", raising=False)
    d = traces_dir()
    assert d.is_relative_to(Path(__file__).resolve().parents[1] / "loadtest")
    assert {"azure_llm_2023_conv.csv", "azure_llm_2023_code.csv", "mooncake_fast25_synthetic_trace.jsonl",
            "README.md"} <= {p.name for p in d.iterdir()}
    readme = (d / "README.md").read_text()
    assert "Apache License 2.0" in readme and "FAST25-release/traces/synthetic_trace.jsonl" in readme
    monkeypatch.setenv("FLOWPREFILL_TRACES", str(tmp_path))
    assert traces_dir() == tmp_path


def test_every_shipped_trace_is_package_data() -> None:
    """A wheel carries every trace the workloads read, not only the checkout."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["loadtest"]
    for f in (root / "loadtest" / "traces").iterdir():
        assert any(fnmatch.fnmatch(f"traces/{f.name}", pat) for pat in patterns), f.name


def test_azure_mix_merges_both_traces() -> None:
    from loadtest.workload import azure_mix

    w = azure_mix()
    assert len(w.requests) == 19366 + 8819  # the rows of both traces
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.requests, w.requests[1:], strict=False))
    assert {r.slo_class for r in w.requests} == {"interactive", "standard", "relaxed", "batch"}


def test_compress_keeps_order_and_lands_the_longest_on_the_bound() -> None:
    from loadtest.workload import compress

    lengths = [2049, 3000, 11_587, 38_596, 191_378]
    out = [compress(n, 2048, 8192, 191_378) for n in lengths]
    assert out == sorted(out) and len(set(out)) == len(out)
    assert out[0] == 2049 and out[-1] == 8192
    assert 3400 <= out[2] <= 3550  # Mooncake's median prompt, as workload.compress says
    assert compress(5000, 2048, 8192, 8000) == 5000  # all fit already: unchanged


def test_long_mix_of_small_traces(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Mooncake's long prompts (compressed) and Azure's short ones, each at its own time, over the
    Mooncake trace's span; Mooncake's short prompts and Azure's long ones and late ones left out."""
    from loadtest.workload import long_mix, named_or_trace

    head_ = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    write(tmp_path, "azure_llm_2023_conv.csv", head_ + "2023-11-16 18:00:00.0,500,7\n"
          "2023-11-16 18:00:03.0,3000,7\n2023-11-16 18:00:05.0,1500,7\n2023-11-16 18:05:00.0,100,7\n")
    write(tmp_path, "azure_llm_2023_code.csv", head_ + "2023-11-16 18:00:01.5,2048,9\n")
    write(tmp_path, "mooncake_fast25_synthetic_trace.jsonl", "\n".join(json.dumps(x) for x in [
        {"timestamp": 0, "input_length": 40_000, "output_length": 6, "hash_ids": list(range(79))},
        {"timestamp": 2000, "input_length": 300, "output_length": 6, "hash_ids": [80]},
        {"timestamp": 4000, "input_length": 191_378, "output_length": 3, "hash_ids": [81]},
        {"timestamp": 200_000, "input_length": 2500, "output_length": 2, "hash_ids": [82]}]))
    monkeypatch.setenv("FLOWPREFILL_TRACES", str(tmp_path))  # over 100 s: read as milliseconds
    w = long_mix()
    got = [(r.arrival_s, r.input_tokens, r.slo_class) for r in w.requests]
    assert got[:2] == [(0.0, compress_(40_000), "batch"), (0.0, 500, "interactive")]
    assert got[2:] == [(1.5, 2048, "standard"), (4.0, 8192, "batch"), (5.0, 1500, "standard"),
                       (200.0, compress_(2500), "relaxed")]
    assert all(r.prefix == () for r in w.requests)  # hash ids name blocks of the uncompressed prompt
    assert w.name == "long-mix" and "mooncake" in w.source and "azure-mix" in w.source
    assert w.class_rule == ClassRule().describe()
    assert named_or_trace("long-mix").requests == w.requests
    assert len(named_or_trace("azure-mix").requests) == 5
    with pytest.raises(TraceError, match="does not exist"):
        named_or_trace("long_mix")  # neither a name nor a file


def compress_(n: int) -> int:
    from loadtest.workload import compress

    return compress(n, 2048, 8192, 191_378)


def test_long_mix_on_the_shipped_traces() -> None:
    """The composition docs/loadtest.md states: 30 % long over the whole mix, every class in its first
    80 requests (the hogs benchmark's), long ones relaxed or batch, short ones interactive or standard."""
    from loadtest.workload import head, long_mix

    w = long_mix()
    longs = [r for r in w.requests if r.input_tokens > 2048]
    assert len(longs) == 2692  # the Mooncake trace's prompts over 2,048 tokens
    assert 0.28 < len(longs) / len(w.requests) < 0.32
    assert max(r.input_tokens for r in longs) == 8192
    assert {r.slo_class for r in longs} == {"relaxed", "batch"}
    assert {r.slo_class for r in w.requests if r.input_tokens <= 2048} == {"interactive", "standard"}
    first = head(w, 80).requests
    assert {r.slo_class for r in first} == {"interactive", "standard", "relaxed", "batch"}
    assert sum(r.input_tokens > 2048 for r in first) == 47
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.requests, w.requests[1:], strict=False))
