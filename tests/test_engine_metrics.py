"""The worker's decode metrics (telemetry/metrics.py) count what the engine did: every token, every
gap between two tokens (an evicted answer's recompute included), each answer's time per token,
durations and how requests ended. Read back through prometheus_client's own parser."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import EngineFactory
from prometheus_client.parser import text_string_to_metric_families
from test_engine import Sink, assert_idle_and_free, tokens

from engine.core.engine import Engine
from engine.core.observer import EngineObserver
from engine.core.request import Request, SamplingParams
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
    assert gaps == pytest.approx(a.times.last_token_time - a.times.first_token_time)  # the gaps tile the answer
    assert got[("flowprefill_time_per_output_token_seconds_count", std)] == 1
    assert got[("flowprefill_time_per_output_token_seconds_sum", std)] == pytest.approx(gaps / 9)
    assert got[("flowprefill_request_duration_seconds_sum", std)] == pytest.approx(a.times.finish_time - a.arrival_time)
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


def test_a_disaggregated_request_is_counted_once(make_engine: EngineFactory) -> None:
    """Summed over its prefill and decode workers, as Prometheus sums: one request, its prompt once,
    its tokens once, its TTFT where its prompt was prefilled. (Found by review: counted twice.)"""
    from engine.core import handoff
    from engine.core.request import Sampled

    prefill, decode = make_engine(), make_engine()
    per_worker = [EngineMetrics(prefill), EngineMetrics(decode)]
    prompt = tokens(100, seed=9)
    exported: dict[str, torch.Tensor] = {}  # the prompt's KV, given at its first token
    first = Request(request_id="p", prompt_token_ids=prompt, kv_sink=exported.update,
                    sampling=SamplingParams(max_tokens=1, temperature=0.0))
    first.sink = sink = Sink(first)
    prefill.add_request(first)
    assert sink.wait() == "length"
    kv, token = handoff.unpack(handoff.pack(exported, Sampled(first.output_token_ids[0])))
    req = Request(request_id="d", prompt_token_ids=prompt,
                  sampling=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    req.sink = sink = Sink(req)
    decode.add_prefilled(req, kv, token)
    assert sink.wait() == "length"

    def total(name: str) -> float:
        return sum(v for m in per_worker for (n, _), v in samples(m).items() if n == name)

    assert total("flowprefill_generation_tokens_total") == 5
    assert total("flowprefill_prompt_tokens_total") == 100
    assert total("flowprefill_requests_finished_total") == 1
    assert total("flowprefill_request_duration_seconds_count") == 1
    assert total("flowprefill_time_to_first_token_seconds_count") == 1
    assert samples(per_worker[0])[("flowprefill_time_to_first_token_seconds_count", (("slo_class", "standard"),))] == 1


class Broken(EngineObserver):
    """Telemetry with a bug in every hook."""

    def __getattribute__(self, name: str) -> object:
        if name.startswith("on_"):
            def fail(*_: object) -> None:
                raise RuntimeError(f"{name} is broken")
            return fail
        return super().__getattribute__(name)


def test_a_failing_observer_fails_no_request(make_engine: EngineFactory) -> None:
    eng = make_engine(kv_capacity_tokens=10 * 16)
    eng.observers.append(Broken())
    reqs = [submit(eng, f"r{i}", 40 + 10 * i, 30) for i in range(3)]  # evictions too: a 10-block cache
    for req, sink in reqs:
        assert sink.wait() == "length" and len(req.output_token_ids) == 30
    assert_idle_and_free(eng)
