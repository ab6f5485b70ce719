"""The worker's decode metrics (telemetry/metrics.py) count what the engine did: every token, every
gap between two tokens (an evicted answer's recompute included), each answer's time per token,
durations and how requests ended. Read back through prometheus_client's own parser."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import EngineFactory
from prometheus_client.parser import text_string_to_metric_families
from test_engine import Sink, assert_idle_and_free, tokens

from engine.engine import Engine
from engine.request import Request, SamplingParams
from telemetry.metrics import EngineMetrics


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_block_size=16, kv_capacity_tokens=4096)
    yield factory
    factory.close()


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def submit(eng: Engine, rid: str, n_prompt: int, max_tokens: int, slo: str = "standard") -> tuple[Request, Sink]:
    req = Request(request_id=rid, prompt_token_ids=tokens(n_prompt, seed=len(rid)), slo_class=slo,
                  sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    req.sink = sink = Sink(req)
    eng.add_request(req)
    return req, sink


def test_tokens_gaps_and_endings_are_counted(make_engine: EngineFactory) -> None:
    eng = make_engine()
    metrics = EngineMetrics(eng)
    a, sink_a = submit(eng, "a", 40, 10)
    _, sink_b = submit(eng, "bb", 25, 6, slo="batch")
    assert sink_a.wait() == "length" and sink_b.wait() == "length"
    assert_idle_and_free(eng)
    got = samples(metrics)
    std, batch = (("slo_class", "standard"),), (("slo_class", "batch"),)
    assert got[("flowprefill_generation_tokens_total", std)] == 10
    assert got[("flowprefill_generation_tokens_total", batch)] == 6
    assert got[("flowprefill_prompt_tokens_total", std)] == 40
    assert got[("flowprefill_inter_token_latency_seconds_count", std)] == 9  # gaps after the first token
    assert got[("flowprefill_inter_token_latency_seconds_count", batch)] == 5
    gaps = got[("flowprefill_inter_token_latency_seconds_sum", std)]
    assert gaps == pytest.approx(a.last_token_time - a.first_token_time)  # the gaps tile the answer
    assert got[("flowprefill_time_per_output_token_seconds_count", std)] == 1
    assert got[("flowprefill_time_per_output_token_seconds_sum", std)] == pytest.approx(gaps / 9)
    assert got[("flowprefill_request_duration_seconds_sum", std)] == pytest.approx(a.finish_time - a.arrival_time)
    assert got[("flowprefill_requests_finished_total", (("finish_reason", "length"), *std))] == 1
    buckets = {dict(k[1])["le"] for k in got if k[0] == "flowprefill_inter_token_latency_seconds_bucket"}
    assert {"0.1", "0.2"} <= buckets  # the default classes' TBT targets are bucket boundaries


def test_a_cancelled_request_is_counted_as_such(make_engine: EngineFactory) -> None:
    eng = make_engine()
    metrics = EngineMetrics(eng)
    req, sink = submit(eng, "c", 30, 2000)
    assert sink.first_token.wait(60)
    eng.cancel("c")
    assert sink.wait() == "cancelled"
    got = samples(metrics)
    std = ("slo_class", "standard")
    assert got[("flowprefill_requests_finished_total", (("finish_reason", "cancelled"), std))] == 1
    assert got[("flowprefill_generation_tokens_total", (std,))] == len(req.output_token_ids)
