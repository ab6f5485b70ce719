"""KV that grows with the answer (EngineConfig.kv_reservation = "grow"): a batch takes its prefill's
blocks and the next token's, an answer takes a block when it crosses into one, and when blocks run
out an answer is evicted and recomputed. Checked: what is held when, recomputed answers equal
uninterrupted ones (tokens and streamed text), cancel while evicted, the full-reservation policy, and
the pool coming back whole."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import EngineFactory
from test_engine import Sink, assert_idle_and_free, tokens

from engine.core.config import ModelConfig
from engine.core.engine import Engine
from engine.core.kv_cache import BlockPool
from engine.core.observer import EngineObserver
from engine.core.request import Request, SamplingParams, TokenOutput
from engine.core.scheduler import Scheduler, make_policy
from engine.model.cost import OpCost

BS = 16


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_block_size=BS, kv_capacity_tokens=64 * BS)
    yield factory
    factory.close()


class Evictions(EngineObserver):
    def __init__(self, eng: Engine) -> None:
        self.requests: list[str] = []
        self.happened = threading.Event()
        eng.observers.append(self)

    def on_evict(self, req: Request, now: float) -> None:
        self.requests.append(req.request_id)
        self.happened.set()


def submit(eng: Engine, rid: str, prompt: list[int], max_tokens: int, sink_cls: type[Sink] = Sink,
           **sampling: object) -> tuple[Request, Sink]:
    req = Request(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **sampling}))  # type: ignore[arg-type]
    sink = sink_cls(req)
    req.sink = sink
    eng.add_request(req)
    return req, sink


class BlockCounter(Sink):
    """Records, at each token, how many blocks the request holds and how many tokens it has."""

    def __init__(self, req: Request) -> None:
        super().__init__(req)
        self.held: list[tuple[int, int]] = []

    def __call__(self, out: TokenOutput) -> None:
        if out.token_ids and not out.finish_reason:
            self.held.append((len(self.req.block_table), self.req.num_tokens))
        super().__call__(out)


@pytest.mark.parametrize("reservation", ["grow", "full"])
def test_an_answer_takes_blocks_as_it_grows(make_engine: EngineFactory, reservation: str) -> None:
    eng = make_engine(kv_reservation=reservation)
    _, sink = submit(eng, "a", tokens(40, seed=1), max_tokens=57, sink_cls=BlockCounter)
    assert sink.wait() == "length"
    held = sink.held  # type: ignore[attr-defined]
    assert len(held) == 56
    blocks = eng.kv.blocks_for
    if reservation == "full":
        assert all(n == blocks(97) == 7 for n, _ in held)
    else:
        assert held[0] == (blocks(41), 41)  # the prompt's and the first token's, whose KV decode writes
        # the token just sampled is not written yet: the blocks cover what is, or one more block
        assert all(blocks(t - 1) <= n <= blocks(t) for n, t in held), held
        assert held[-1][0] == blocks(95) == 6  # the last token's KV is never written: one block less
    assert_idle_and_free(eng)


def crowd(eng: Engine, n: int = 6, prefix: str = "r") -> list[tuple[Request, Sink]]:
    """Answers that together need more KV than a 24-block pool holds, some sampled with seeds."""
    out = []
    for i in range(n):
        sampling = {"temperature": 0.8, "seed": i} if i % 2 else {}
        out.append(submit(eng, f"{prefix}{i}", tokens(30 + 7 * i, seed=10 + i), max_tokens=70, **sampling))
    return out


@pytest.mark.parametrize("policy", ["flowprefill", "fcfs", "chunked:32"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_evicted_answers_are_recomputed_exactly(make_engine: EngineFactory, policy: str,
                                                prefix_caching: bool) -> None:
    """Six answers of 100-odd tokens in a 24-block pool: some are evicted (recomputed from their cached
    blocks, or from scratch without the prefix cache), yet every answer's tokens and streamed text
    equal an engine's that had room for all of them at once."""
    small = make_engine(policy, kv_capacity_tokens=24 * BS, prefix_caching=prefix_caching)
    big = make_engine(policy)
    evictions, none = Evictions(small), Evictions(big)
    got, want = crowd(small), crowd(big)
    for (req, sink), (ref, ref_sink) in zip(got, want, strict=True):
        assert sink.wait() == "length" and ref_sink.wait() == "length"
        assert req.output_token_ids == ref.output_token_ids, req.request_id
        assert "".join(o.text for o in sink.outputs) == "".join(o.text for o in ref_sink.outputs)
        assert req.ttft is not None and req.times.first_token_time == sink.req.times.first_token_time
    assert evictions.requests and not none.requests
    assert sum(r.times.evictions for r, _ in got) == len(evictions.requests)
    for eng in (small, big):
        assert_idle_and_free(eng)


def test_full_reservation_never_evicts(make_engine: EngineFactory) -> None:
    """The same crowd with prompt + max_tokens reserved up front: answers wait for room instead."""
    eng = make_engine(kv_capacity_tokens=24 * BS, kv_reservation="full")
    evictions = Evictions(eng)
    for _, sink in crowd(eng):
        assert sink.wait() == "length"
    assert not evictions.requests
    assert_idle_and_free(eng)


class Squeeze(Sink):
    """On its first token (on the engine thread) takes every free block, as other requests would,
    so the answer runs out of room at its next block and is evicted."""

    def __init__(self, req: Request) -> None:
        super().__init__(req)
        self.taken: list[int] | None = None

    def __call__(self, out: TokenOutput) -> None:
        if out.token_ids and self.taken is None:
            self.taken = self.eng.kv.allocate_blocks(self.eng.kv.num_free_blocks)
        super().__call__(out)


def test_an_evicted_answer_can_be_cancelled_while_it_waits(make_engine: EngineFactory) -> None:
    from telemetry.metrics import EngineMetrics

    eng = make_engine(kv_capacity_tokens=10 * BS)
    metrics, evictions = EngineMetrics(eng), Evictions(eng)
    Squeeze.eng = eng  # type: ignore[attr-defined]
    req, sink = submit(eng, "a", tokens(20, seed=3), max_tokens=100, sink_cls=Squeeze)
    assert evictions.happened.wait(60)  # after its 13th token, whose KV goes into a third block
    assert evictions.requests == ["a"] and req.times.evictions == 1 and "a" in eng.answers.evicted
    assert eng.num_waiting == 1 and req.block_table == []  # it waits: 3 blocks needed, 2 free
    assert b"flowprefill_requests_evicted 1.0" in metrics.render()  # a stalled stream, counted
    # its next token is due a TBT target after its recompute: it waits feasible, not hopeless
    assert req.deadline - eng.clock() - eng.scheduler.predict_s(req) > 0
    eng.cancel("a")
    assert sink.wait() == "cancelled"
    assert len(req.output_token_ids) == 13
    assert b'flowprefill_decode_preemptions_total{slo_class="standard"} 1.0' in metrics.render()
    assert b"flowprefill_requests_evicted 0.0" in metrics.render()
    eng.call(lambda: eng._free_blocks(sink.taken))  # type: ignore[attr-defined]
    assert_idle_and_free(eng)


def test_an_evicted_answer_resumes_when_blocks_come_back(make_engine: EngineFactory) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from telemetry.metrics import EngineMetrics

    eng, ref_eng = make_engine(kv_capacity_tokens=10 * BS), make_engine()
    evictions, metrics = Evictions(eng), EngineMetrics(eng)
    Squeeze.eng = eng  # type: ignore[attr-defined]
    prompt = tokens(20, seed=4)
    req, sink = submit(eng, "a", prompt, max_tokens=40, sink_cls=Squeeze)
    assert evictions.happened.wait(60)
    eng.call(lambda: eng._free_blocks(sink.taken))  # type: ignore[attr-defined]
    assert sink.wait() == "length"
    ref, ref_sink = submit(ref_eng, "ref", prompt, max_tokens=40)
    assert ref_sink.wait() == "length"
    assert req.output_token_ids == ref.output_token_ids
    assert req.cached_tokens == 0  # usage reports the prompt's cache hits, not the recompute's
    gaps = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples
            if s.name.startswith("flowprefill_inter_token_latency_seconds_") and not s.name.endswith("bucket")}
    assert gaps["flowprefill_inter_token_latency_seconds_count"] == 39  # the wait for blocks is one of them
    assert gaps["flowprefill_inter_token_latency_seconds_sum"] == pytest.approx(req.times.last_token_time
                                                                                - req.times.first_token_time)
    assert_idle_and_free(eng)


def test_new_batches_leave_a_block_per_growing_answer() -> None:
    pool = BlockPool(BS, 10 * BS)
    growing = 3
    s = Scheduler(make_policy("fcfs"), lambda reqs, spans: None, OpCost(ModelConfig(), 1e-6, 1e-6, 1e-8), pool, 4096,  # type: ignore[arg-type]
                  reserve_tokens=lambda r: r.num_tokens + 1, headroom_blocks=lambda: growing)
    fits = Request(request_id="fits", prompt_token_ids=[1] * (7 * BS - 1))  # 7 blocks
    too_big = Request(request_id="big", prompt_token_ids=[1] * (8 * BS - 1))  # 8 blocks
    assert s.fill([fits]) == [fits] and s.fill([too_big]) == []
    growing = 0
    assert s.fill([too_big]) == [too_big]


def test_a_handed_off_answer_evicted_on_its_decode_worker_is_recomputed_there(make_engine: EngineFactory) -> None:
    """PD disaggregation: the decode worker holds no prefix of the prompt (it was prefilled
    elsewhere), yet an evicted hand-off recomputes there to exactly what one worker alone gives."""
    from engine.core import handoff
    from engine.core.request import Sampled

    prefill, decode, alone = make_engine(), make_engine(kv_capacity_tokens=10 * BS), make_engine()
    evictions = Evictions(decode)
    prompt = tokens(20, seed=5)
    exported: dict[str, torch.Tensor] = {}  # the prompt's KV, given at its first token
    first = Request(request_id="p", prompt_token_ids=prompt, kv_sink=exported.update,
                    sampling=SamplingParams(max_tokens=1, temperature=0.0))
    first.sink = sink = Sink(first)
    prefill.add_request(first)
    assert sink.wait() == "length" and exported
    kv, token = handoff.unpack(handoff.pack(exported, Sampled(first.output_token_ids[0])))
    Squeeze.eng = decode  # type: ignore[attr-defined]
    req = Request(request_id="d", prompt_token_ids=prompt,
                  sampling=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    sink = Squeeze(req)
    req.sink = sink
    decode.add_prefilled(req, kv, token)
    assert evictions.happened.wait(60)
    decode.call(lambda: decode._free_blocks(sink.taken))  # type: ignore[arg-type]
    assert sink.wait() == "length"
    ref, ref_sink = submit(alone, "ref", prompt, max_tokens=40)
    assert ref_sink.wait() == "length"
    assert req.output_token_ids == ref.output_token_ids and req.times.evictions == 1
    assert req.block_hashes is None  # never looked up in this worker's prefix cache (nor counted so)
    assert_idle_and_free(decode)


def test_an_eviction_shows_on_the_request_trace(make_engine: EngineFactory) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from telemetry.tracing import EngineTracer

    eng = make_engine(kv_capacity_tokens=10 * BS)
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = EngineTracer(eng, "tiny")
    tracer.tracer = provider.get_tracer("test")
    evictions = Evictions(eng)
    Squeeze.eng = eng  # type: ignore[attr-defined]
    req = Request(request_id="a", prompt_token_ids=tokens(20, seed=6),
                  sampling=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    req.sink = sink = Squeeze(req)
    tracer.start(req, "text_completion")
    eng.add_request(req)
    assert evictions.happened.wait(60)
    eng.call(lambda: eng._free_blocks(sink.taken))  # type: ignore[arg-type]
    assert sink.wait() == "length"
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "text_completion tiny")
    assert root.attributes["flowprefill.evictions"] == 1
    evicted = [s for s in spans if s.name == "queue" and s.attributes.get("flowprefill.evicted")]
    assert len(evicted) == 1 and evicted[0].attributes["flowprefill.output_tokens"] == 13
    decode = next(s for s in spans if s.name == "decode")
    prefills = sorted((s for s in spans if s.name == "prefill"), key=lambda s: s.start_time)
    assert len(prefills) == 2  # the prompt's, then the recompute's, inside decode after the eviction
    assert decode.start_time <= evicted[0].start_time <= evicted[0].end_time <= prefills[1].start_time
    assert prefills[1].end_time <= decode.end_time


def test_the_benchmark_runs_and_reports(tmp_path: Path) -> None:
    import json

    import torch

    from engine.bench import kv_growth

    threads = torch.get_num_threads()
    try:
        assert kv_growth.main(["--requests", "8", "--rate", "40", "--repeats", "1", "--kv-capacity-tokens", "6144",
                               "--max-prompt-tokens", "512", "--threads", "1", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "kv_growth.json").read_text())
    full, grow = results["summary"]["full"], results["summary"]["grow"]
    assert full["evictions"] == 0 and full["decoding_max"] <= 6144 // (16 + 1024)  # prompt + 1,024 each
    assert full["output_tokens"] == grow["output_tokens"] > 0  # every answer reached its trace length
    assert set(results["timelines"]) == {"full", "grow"}
    assert (tmp_path / "kv_growth.png").stat().st_size > 10_000


@pytest.mark.parametrize("policy", ["flowprefill", "priority", "chunked:16", "fcfs", "edf"])
def test_an_evicted_answer_does_not_stall_the_prefill_holding_the_kv(make_engine: EngineFactory,
                                                                      policy: str) -> None:
    """An evicted answer needs a block more than it gave back, and ranks first. Were the policy to
    wait for it with nothing chosen, the prefill holding the KV (a formed batch, or a prompt between
    its chunks) would never run, and nothing would ever free a block. (Found by review: it hung
    under flowprefill, priority and chunked.)"""
    eng = make_engine(policy, start=False, kv_capacity_tokens=10 * BS)
    e, e_sink = submit(eng, "e", tokens(20, seed=7), max_tokens=100)  # 2 blocks
    while "e" not in eng.answers.running:
        eng._iteration()  # the engine thread's loop, driven here
    p, p_sink = submit(eng, "p", tokens(7 * BS - 1, seed=8), max_tokens=4)  # 7 blocks: 1 left, the headroom
    p.deadline += 100  # a relaxed prompt: the evicted answer ranks first
    eng._take_inbox()  # its arrival, as the engine thread takes it
    while not e.times.evictions:  # p's prefill is long: decode steps fall due meanwhile
        eng._decode_step()  # e takes the last block, then is evicted at 49 tokens
    assert eng.kv.num_free_blocks == 3 < eng.kv.blocks_for(e.num_tokens + 1) == 4
    eng.start()
    assert e_sink.wait() == "length" and p_sink.wait() == "length"
    assert_idle_and_free(eng)


def test_an_urgent_arrival_that_must_wait_for_kv_does_not_stall_the_batch_holding_it(
        make_engine: EngineFactory) -> None:
    """The same with prompt + max_tokens reserved up front (it hung before KV grew, too): a relaxed
    prompt's batch holds 7 of 10 blocks, an urgent one needing 4 arrives and heads the order."""
    eng = make_engine(start=False, kv_capacity_tokens=10 * BS, kv_reservation="full")
    relaxed = Request(request_id="p", prompt_token_ids=tokens(100, seed=9), ttft_target_s=100.0,
                      sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    relaxed.sink = p_sink = Sink(relaxed)
    eng.add_request(relaxed)
    urgent = Request(request_id="a", prompt_token_ids=tokens(40, seed=10), ttft_target_s=0.5,
                     sampling=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    urgent.sink = a_sink = Sink(urgent)
    eng.add_request(urgent)
    eng._take_inbox()  # not started: this thread takes the arrivals, as the engine thread would
    assert eng.scheduler.chosen is not None and eng.scheduler.chosen.head is relaxed
    eng.start()
    assert a_sink.wait() == "length" and p_sink.wait() == "length"
    assert_idle_and_free(eng)
