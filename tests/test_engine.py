"""The Engine end to end on the embedded default model: preemption under FlowPrefill (and none
under FCFS), cancellation in every state, error paths, input validation, KV accounting.

Timing-sensitive moments are made deterministic with a *gate*: the model's prefill generator of a
chosen batch (recognised by a marker token at the start of its first prompt) blocks after a given
step until the test releases it, so the test can add or cancel requests while that batch sits at a
known operator boundary.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterator
from typing import ClassVar

import pytest
import torch
from helpers import EngineFactory

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, RequestState, SamplingParams, TokenOutput

WAIT_S = 60.0  # generous: the shared CPUs are slow; a hang still ends the test
LONG_MARK, URGENT_MARK, OTHER_MARK = 300, 301, 302  # prompt markers (specials of the byte vocabulary)

@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=16384, kv_block_size=64)
    yield factory
    for gate in Gate.all:
        gate.release.set()
    Gate.all.clear()
    factory.close()


class Gate:
    """Blocks the prefill of batches whose first prompt starts with `marker`, after step `at`."""

    all: ClassVar[list[Gate]] = []

    def __init__(self, eng: Engine, monkeypatch: pytest.MonkeyPatch, marker: int, at: int) -> None:
        self.marker, self.at = marker, at
        self.reached, self.release = threading.Event(), threading.Event()
        inner = eng.model.prefill

        def prefill(token_ids: list[list[int]], *args: object, **kw: object) -> Generator[int, None, torch.Tensor]:
            gen = inner(token_ids, *args, **kw)
            return self._wrap(gen) if token_ids and token_ids[0] and token_ids[0][0] == marker else gen

        monkeypatch.setattr(eng.model, "prefill", prefill)
        Gate.all.append(self)

    def _wrap(self, gen: Generator[int, None, torch.Tensor]) -> Generator[int, None, torch.Tensor]:
        try:
            while True:
                try:
                    i = next(gen)
                except StopIteration as stop:
                    return stop.value
                if i == self.at:
                    self.reached.set()
                    if not self.release.wait(WAIT_S):
                        raise RuntimeError("gate never released")
                yield i
        finally:
            gen.close()

    def wait(self) -> None:
        assert self.reached.wait(WAIT_S), f"the gated batch (marker {self.marker}) never reached step {self.at}"


class Sink:
    def __init__(self, req: Request) -> None:
        self.req = req
        self.outputs: list[TokenOutput] = []
        self.done = threading.Event()
        self.blocks_at_finish: int | None = None
        self.first_token = threading.Event()

    def __call__(self, out: TokenOutput) -> None:
        assert not self.done.is_set(), f"{out.request_id}: output after the finish"
        self.outputs.append(out)
        if out.token_ids:
            self.first_token.set()
        if out.finish_reason:
            self.blocks_at_finish = len(self.req.block_table)
            self.done.set()

    def wait(self) -> str:
        assert self.done.wait(WAIT_S), f"{self.req.request_id} never finished"
        return self.finish

    @property
    def finish(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]


def tokens(n: int, marker: int | None = None, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    ids = [rng.randrange(32, 127) for _ in range(n)]
    if marker is not None:
        ids[0] = marker
    return ids


def submit(eng: Engine, rid: str, n: int, marker: int | None = None, *, max_tokens: int = 4,
           ttft_s: float = 100.0, **sampling: object) -> tuple[Request, Sink]:
    req = Request(request_id=rid, prompt_token_ids=tokens(n, marker, seed=zlib.crc32(rid.encode())),
                  sampling=SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                                             **sampling}),  # type: ignore[arg-type]
                  ttft_target_s=ttft_s)
    sink = Sink(req)
    req.sink = sink
    eng.add_request(req)
    return req, sink


def wait_until(pred: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def assert_idle_and_free(eng: Engine) -> None:
    assert wait_until(lambda: eng.kv.num_free_blocks == eng.kv.num_blocks, 5.0), (
        f"KV leak: {eng.kv.num_blocks - eng.kv.num_free_blocks} blocks still held")
    assert eng.kv.usage == 0.0
    assert eng.scheduler.pool == []
    assert eng.num_waiting == 0
    assert eng.num_decoding == 0 and not eng.answers.evicted


def test_generate_names_each_request_anew_and_can_give_up_waiting(make_engine: Callable[..., Engine]) -> None:
    """Sequential generate() calls never reuse a request id (they were named by a list's id(), which a
    freed list hands on: `plan`'s engine pass once pooled 100 prompts as 43); a wait has a bound."""
    eng = make_engine()
    ids = [r.request_id for _ in range(20) for r in eng.generate([[1, 2, 3]], SamplingParams(max_tokens=1))]
    assert len(set(ids)) == 20
    named = eng.generate([[4, 5]], SamplingParams(max_tokens=1), request_ids=["mine"])
    assert [r.request_id for r in named] == ["mine"] and named[0].finish_reason == "length"
    idle = make_engine(start=False)  # never started: nothing is ever served
    with pytest.raises(TimeoutError, match=r"did not finish in 0\.05 s"):
        idle.generate([[1, 2]], SamplingParams(max_tokens=1), timeout_s=0.05)


# -- validation --------------------------------------------------------------------------------

def test_bad_input_raises_value_error(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine(start=False, kv_capacity_tokens=4096)
    ctx = eng.model.cfg.max_position_embeddings
    vocab = eng.model.cfg.vocab_size

    def req(ids: list[int], **sampling: object) -> Request:
        return Request(request_id=f"bad-{random.random()}", prompt_token_ids=ids,
                       sampling=SamplingParams(**sampling))  # type: ignore[arg-type]

    bad = [
        req([]),  # empty prompt
        req([1, 2, 3], max_tokens=ctx),  # prompt + max_tokens over the context
        req([1] * (ctx - 3), max_tokens=4),
        req([1, vocab, 2]),  # token id out of the vocabulary
        req([-1, 2]),
        req([1, 2], max_tokens=-3),  # (0 is a prefill only: echo's scored prompt, test_echo.py)
        req([1, 2], temperature=-0.5),
        req([1, 2], top_p=0.0),
        req([1, 2], top_k=-1),
        req([1] * 4000, max_tokens=200),  # more KV than the whole pool (4096 tokens)
    ]
    for r in bad:
        with pytest.raises(ValueError):
            eng.add_request(r)
    assert eng.num_waiting == 0 and eng.scheduler.pool == []
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    ok = req([1, 2, 3], max_tokens=ctx - 3)  # exactly the context is allowed by the model...
    with pytest.raises(ValueError):  # ...but not by this 4096-token KV pool
        eng.validate(ok)
    fine = Request(request_id="fine", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=5))
    eng.add_request(fine)
    with pytest.raises(ValueError):  # duplicate id
        eng.add_request(Request(request_id="fine", prompt_token_ids=[4]))


# -- preemption --------------------------------------------------------------------------------

def test_flowprefill_preempts_and_records_the_suspension(make_engine: Callable[..., Engine],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    gate = Gate(eng, monkeypatch, LONG_MARK, at=5)
    long, long_sink = submit(eng, "long", 1500, LONG_MARK, ttft_s=100.0, max_tokens=3)
    gate.wait()
    batch = next(b for b in eng.scheduler.pool if b.head is long)
    assert batch.next_step == 5  # advance() has not returned yet
    assert len(batch.steps) > 20, "the default step budget must split a 1500-token prefill"
    urgent, urgent_sink = submit(eng, "urgent", 24, URGENT_MARK, ttft_s=5.0, max_tokens=3)
    gate.release.set()  # the engine thread takes the arrival at the boundary after step 5, and switches
    assert urgent_sink.wait() == "length"
    assert long_sink.wait() == "length"

    assert eng.preemptions >= 1
    assert len(long.times.suspensions) == 1
    s = long.times.suspensions[0]
    stopped_before = batch.steps[6]  # it stopped at the boundary after step 5
    assert (s.layer, s.operator) == (stopped_before.layer, stopped_before.op)
    assert s.tokens_done == stopped_before.rows[0]
    assert s.preempted_by == "urgent"
    assert s.stop_latency_s >= 0.0
    assert s.end is not None and s.end >= s.start
    assert not urgent.times.suspensions
    # the urgent request got its first token before the long one, which ran in two segments
    assert urgent.times.first_token_time < long.times.first_token_time
    assert len(long.times.segments) == 2
    assert long.times.segments[0][1] <= urgent.times.prefill_start <= long.times.segments[1][0]
    assert len(long_sink.tokens) == 3 and len(urgent_sink.tokens) == 3
    assert long.state is RequestState.FINISHED and urgent.state is RequestState.FINISHED
    assert_idle_and_free(eng)


def test_fcfs_never_preempts(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("fcfs")
    gate = Gate(eng, monkeypatch, LONG_MARK, at=5)
    long, long_sink = submit(eng, "long", 1500, LONG_MARK, ttft_s=100.0)
    gate.wait()
    urgent, urgent_sink = submit(eng, "urgent", 24, URGENT_MARK, ttft_s=0.5)
    others = [submit(eng, f"o{i}", 10 + i, ttft_s=0.1 * (i + 1)) for i in range(3)]
    gate.release.set()
    for _, sink in [(long, long_sink), (urgent, urgent_sink), *others]:
        assert sink.wait() == "length"
    assert eng.preemptions == 0
    assert long.times.suspensions == [] and len(long.times.segments) == 1
    assert urgent.times.prefill_start >= long.times.first_token_time
    assert all(not r.times.suspensions for r, _ in others)
    assert_idle_and_free(eng)


# -- cancellation --------------------------------------------------------------------------------

def test_cancel_suspended_batch_frees_everything(make_engine: Callable[..., Engine],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    long_gate = Gate(eng, monkeypatch, LONG_MARK, at=3)
    urgent_gate = Gate(eng, monkeypatch, URGENT_MARK, at=0)
    long, long_sink = submit(eng, "long", 1500, LONG_MARK, ttft_s=100.0, max_tokens=8)
    long_gate.wait()
    batch = next(b for b in eng.scheduler.pool if b.head is long)
    _, urgent_sink = submit(eng, "urgent", 24, URGENT_MARK, ttft_s=5.0)
    long_gate.release.set()
    urgent_gate.wait()  # the urgent batch has run a step: the long one is suspended
    assert long.state is RequestState.SUSPENDED
    assert eng.preemptions == 1
    assert long.block_table, "a suspended request keeps its KV"
    eng.cancel("long")
    urgent_gate.release.set()
    assert long_sink.wait() == "cancelled"
    assert long_sink.tokens == [] and len(long_sink.outputs) == 1
    assert long_sink.blocks_at_finish == 0, "a dropped batch's KV must be freed before the client hears"
    assert long.state is RequestState.CANCELLED and long.finish_reason == "cancelled"
    assert batch not in eng.scheduler.pool
    assert urgent_sink.wait() == "length"
    assert long.times.first_token_time is None
    assert_idle_and_free(eng)


def test_cancel_running_prefill(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    gate = Gate(eng, monkeypatch, LONG_MARK, at=2)
    long, long_sink = submit(eng, "long", 800, LONG_MARK)
    gate.wait()
    eng.cancel("long")
    gate.release.set()
    assert long_sink.wait() == "cancelled"
    assert long.times.first_token_time is None
    assert_idle_and_free(eng)
    # the engine goes on serving
    _, sink = submit(eng, "after", 12)
    assert sink.wait() == "length"
    assert_idle_and_free(eng)


def test_cancel_waiting_request(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    gate = Gate(eng, monkeypatch, LONG_MARK, at=1)
    _, long_sink = submit(eng, "long", 600, LONG_MARK, ttft_s=5.0)
    gate.wait()
    waiting, waiting_sink = submit(eng, "waiting", 30, ttft_s=100.0)  # later deadline: it queues
    assert eng.has_request("waiting")  # in the engine's inbox, taken at the next boundary
    assert waiting.block_table == []
    eng.cancel("waiting")
    gate.release.set()  # cancels are processed by the engine thread, at the next boundary
    assert waiting_sink.wait() == "cancelled"
    assert waiting.times.prefill_start is None and waiting.output_token_ids == []
    assert waiting.state is RequestState.CANCELLED
    assert waiting not in eng.scheduler.waiting
    assert long_sink.wait() == "length"
    assert eng.preemptions == 0
    assert_idle_and_free(eng)


def test_cancel_decoding_request(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    in_decode, go_on = threading.Event(), threading.Event()
    inner = eng.model.decode

    def decode(*args: object, **kw: object) -> torch.Tensor:
        in_decode.set()
        assert go_on.wait(WAIT_S)
        return inner(*args, **kw)

    monkeypatch.setattr(eng.model, "decode", decode)
    req, sink = submit(eng, "dec", 40, max_tokens=500)
    assert in_decode.wait(WAIT_S)  # first token sampled, the first decode step is under way
    assert req.state is RequestState.DECODING and eng.num_decoding == 1
    eng.cancel("dec")
    go_on.set()
    assert sink.wait() == "cancelled"
    assert sink.blocks_at_finish == 0
    assert 1 <= len(req.output_token_ids) <= 3
    assert req.state is RequestState.CANCELLED
    assert_idle_and_free(eng)


def test_cancel_unknown_or_finished_is_a_no_op(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine()
    _, sink = submit(eng, "done", 10, max_tokens=2)
    assert sink.wait() == "length"
    eng.cancel("done")
    eng.cancel("never-existed")
    _, sink2 = submit(eng, "next", 10, max_tokens=2)
    assert sink2.wait() == "length"
    assert len(sink.outputs) == 2 and sink.finish == "length"
    assert_idle_and_free(eng)


# -- error paths ---------------------------------------------------------------------------------

def test_prefill_error_fails_the_batch_and_frees_kv(make_engine: Callable[..., Engine],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("fcfs", start=False)
    broken = {"on": True}
    inner = eng.model._ffn

    def ffn(*args: object) -> torch.Tensor:
        if broken["on"]:
            raise RuntimeError("boom in ffn")
        return inner(*args)

    monkeypatch.setattr(eng.model, "_ffn", ffn)
    # queued before the start: one batch forms, the others wait behind it
    pairs = [submit(eng, f"e{i}", 20 + i, max_tokens=3) for i in range(3)]
    eng.call(eng._take_inbox)
    assert len(eng.scheduler.pool) == 1 and len(eng.scheduler.pool[0].requests) == 1
    eng.start()
    for req, sink in pairs:
        assert sink.wait() == "error"
        assert sink.outputs[-1].error and "boom in ffn" in sink.outputs[-1].error
        assert req.state is RequestState.FAILED and req.finish_reason == "error"
        assert sink.tokens == []
    assert_idle_and_free(eng)
    broken["on"] = False
    _, sink = submit(eng, "healthy", 16, max_tokens=3)
    assert sink.wait() == "length"
    assert_idle_and_free(eng)


def test_decode_error_fails_the_decoding_requests(make_engine: Callable[..., Engine],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine()

    def decode(*args: object, **kw: object) -> torch.Tensor:
        raise RuntimeError("boom in decode")

    monkeypatch.setattr(eng.model, "decode", decode)
    _, sink = submit(eng, "d", 20, max_tokens=5)
    assert sink.done.wait(1.5), "a request whose decode step raises must end"
    assert sink.finish == "error"
    assert_idle_and_free(eng)


@pytest.mark.parametrize("fail_at", [0, 2])  # the first token (prefill) or a later one (decode)
def test_a_request_whose_sampling_fails_fails_alone(make_engine: Callable[..., Engine],
                                                    monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    from engine.core import sampling

    eng = make_engine(start=False)
    inner = sampling.sample_row

    def sample_row(row: torch.Tensor, req: Request, generators: dict) -> int:
        if req.request_id == "bad" and len(req.output_token_ids) == fail_at:
            raise RuntimeError("boom in sampling")
        return inner(row, req, generators)

    monkeypatch.setattr(sampling, "sample_row", sample_row)
    _, bad_sink = submit(eng, "bad", 20, max_tokens=4)
    good, good_sink = submit(eng, "good", 24, max_tokens=4)
    eng.start()
    assert bad_sink.wait() == "error" and "boom in sampling" in (bad_sink.outputs[-1].error or "")
    assert good_sink.wait() == "length" and len(good.output_token_ids) == 4
    assert_idle_and_free(eng)


def test_shutdown_fails_outstanding_requests(make_engine: Callable[..., Engine],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    gate = Gate(eng, monkeypatch, LONG_MARK, at=1)
    _, long_sink = submit(eng, "long", 600, LONG_MARK, ttft_s=5.0)
    gate.wait()
    _, waiting_sink = submit(eng, "waiting", 20, ttft_s=100.0)
    stopper = threading.Thread(target=eng.shutdown)
    stopper.start()
    assert wait_until(lambda: eng._stop, 10.0)  # the stop is requested while the batch sits at the gate
    gate.release.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    for sink in (long_sink, waiting_sink):
        assert sink.wait() == "error"
        assert "shut down" in (sink.outputs[-1].error or "")
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.scheduler.pool == []


# -- mixed workload ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["flowprefill", "fcfs"])
def test_every_request_ends_with_a_finish_reason(make_engine: Callable[..., Engine], policy: str) -> None:
    eng = make_engine(policy, kv_block_size=32)
    rng = random.Random(7)
    pairs: list[tuple[Request, Sink]] = []
    cancelled: set[str] = set()
    for i in range(14):
        kind = rng.random()
        n = rng.choice([1, 5, 40, 200, 700])
        extra: dict[str, object] = {}
        if kind < 0.2:
            extra["stop"] = [chr(rng.randrange(97, 123))]
        if kind > 0.8:
            extra = {"temperature": 1.0, "seed": i}
        req, sink = submit(eng, f"m{i}", n, ttft_s=rng.choice([0.2, 1.0, 30.0]),
                           max_tokens=rng.choice([1, 3, 12]), **extra)
        pairs.append((req, sink))
        if rng.random() < 0.25:
            eng.cancel(req.request_id)
            cancelled.add(req.request_id)
        time.sleep(rng.choice([0.0, 0.0, 0.01]))
    for req, sink in pairs:
        reason = sink.wait()
        assert reason in ("stop", "length", "cancelled"), (req.request_id, reason)
        assert req.finish_reason == reason
        assert sum(1 for o in sink.outputs if o.finish_reason) == 1
        assert len(sink.tokens) <= req.sampling.max_tokens
        if reason == "length":
            assert len(sink.tokens) == req.sampling.max_tokens
        if reason == "cancelled":
            assert req.request_id in cancelled
        if req.request_id not in cancelled:
            assert reason != "cancelled"
            assert req.times.first_token_time is not None and req.ttft is not None and req.ttft >= 0
        assert req.state.done
    if policy == "fcfs":
        assert eng.preemptions == 0
    assert_idle_and_free(eng)


# -- known engine bugs, pinned ----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["flowprefill", "fcfs"])
@pytest.mark.parametrize("how", ["finish", "cancel"])
def test_request_waiting_for_kv_runs_once_kv_is_freed(make_engine: Callable[..., Engine],
                                                      monkeypatch: pytest.MonkeyPatch, policy: str, how: str) -> None:
    # 16 blocks of 64 tokens: the first request holds 10 while it decodes, the second needs 7.
    eng = make_engine(policy, kv_capacity_tokens=1024, kv_block_size=64)
    in_decode, go_on = threading.Event(), threading.Event()
    inner = eng.model.decode

    def decode(*args: object, **kw: object) -> torch.Tensor:
        in_decode.set()
        assert go_on.wait(WAIT_S)
        return inner(*args, **kw)

    monkeypatch.setattr(eng.model, "decode", decode)
    first, first_sink = submit(eng, "first", 560, max_tokens=20)
    second, second_sink = submit(eng, "second", 400, max_tokens=2, ttft_s=200.0)
    assert in_decode.wait(WAIT_S)  # the first request decodes and holds its KV
    assert second in eng.scheduler.waiting and second.block_table == [], "the second must wait for KV"
    if how == "cancel":
        eng.cancel("first")
    go_on.set()
    assert first_sink.wait() == ("cancelled" if how == "cancel" else "length")
    assert second_sink.wait() == "length", "the second request must be scheduled once the first freed its KV"
    assert second.times.prefill_start is not None and second.times.prefill_start >= first.times.finish_time
    assert_idle_and_free(eng)


def test_request_cancelled_in_a_preempted_batch_stays_cancelled(make_engine: Callable[..., Engine],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine("flowprefill")
    first_gate = Gate(eng, monkeypatch, OTHER_MARK, at=0)
    pair_gate = Gate(eng, monkeypatch, LONG_MARK, at=3)
    urgent_gate = Gate(eng, monkeypatch, URGENT_MARK, at=0)
    # While `first` runs, two relaxed requests queue; they are batched together when it completes.
    _, first_sink = submit(eng, "first", 30, OTHER_MARK, ttft_s=1.0)
    first_gate.wait()
    a, a_sink = submit(eng, "a", 400, LONG_MARK, ttft_s=100.0, max_tokens=3)
    b, b_sink = submit(eng, "b", 300, ttft_s=100.5, max_tokens=3)
    first_gate.release.set()
    pair_gate.wait()
    pair = next(batch for batch in eng.scheduler.pool if batch.head is a)
    assert pair.requests == [a, b]
    _, urgent_sink = submit(eng, "urgent", 20, URGENT_MARK, ttft_s=5.0)
    pair_gate.release.set()
    urgent_gate.wait()  # the pair is suspended
    eng.cancel("b")
    urgent_gate.release.set()
    assert b_sink.wait() == "cancelled"
    for sink in (first_sink, urgent_sink, a_sink):
        assert sink.wait() == "length"
    assert b.state is RequestState.CANCELLED
    assert b.output_token_ids == []
    assert_idle_and_free(eng)


def test_admission_sheds_only_sheddable_predicted_misses_and_bounds_the_queue() -> None:
    from engine.core.engine import Engine as _Engine
    from engine.core.request import Request as _Request

    eng = _Engine(EngineConfig(max_waiting=1))  # not started: requests stay queued
    try:
        hopeless = _Request(request_id="h", prompt_token_ids=[65] * 20000, ttft_target_s=0.01, late_s=0.01)
        refusal = eng.admission([hopeless], sheddable=True)
        assert refusal is not None and refusal.reason == "predicted_slo_miss"
        assert "predicted to take" in refusal.message and "late bound" in refusal.message, refusal.message
        assert eng.admission([hopeless], sheddable=False) is None
        eng.add_request(_Request(request_id="q", prompt_token_ids=[65] * 10))
        eng.call(eng._take_inbox)  # not started: this thread takes the arrival, as the engine thread would
        full = eng.admission([_Request(request_id="x", prompt_token_ids=[65] * 10)], sheddable=False)
        assert full is not None and full.reason == "queue_full"
    finally:
        eng.shutdown()


def test_a_miss_only_calibration_predicts_is_admitted_until_a_batch_of_its_size_confirms_it() -> None:
    """A calibration taken on a shared core reads slow (4x measured), and a request refused on it never
    runs to correct it: unconfirmed, a predicted miss within UNCONFIRMED_SPEEDUP is admitted; once a
    batch of that size has run, the same prediction refuses it."""
    from engine.core.engine import Engine as _Engine
    from engine.core.request import Request as _Request
    from engine.core.scheduler import UNCONFIRMED_SPEEDUP
    from engine.model.cost import SeqSpan

    eng = _Engine(EngineConfig())  # not started
    try:
        n = 3000
        cost = eng.scheduler.cost
        predicted = cost.prefill_s([SeqSpan(0, n)])
        def late() -> _Request:  # due, late bound included, in half its predicted time
            return _Request(request_id="l", prompt_token_ids=[65] * n, ttft_target_s=predicted / 4,
                            late_s=predicted / 4)
        assert not cost.confirmed(n)
        assert eng.admission([late()], sheddable=True) is None
        far = _Request(request_id="f", prompt_token_ids=[65] * n, ttft_target_s=predicted / (2 * UNCONFIRMED_SPEEDUP),
                       late_s=0.0)
        assert eng.admission([far], sheddable=True).reason == "predicted_slo_miss"
        cost.observe(n, predicted, predicted)  # a batch of this size ran as predicted
        assert cost.confirmed(n)
        assert eng.admission([late()], sheddable=True).reason == "predicted_slo_miss"
    finally:
        eng.shutdown()


def test_a_request_that_can_only_be_late_is_admitted_and_served_late() -> None:
    """Admission refuses a sheddable request only when, at the speed observed now, even its class's
    late bound cannot hold; one that misses only its target is served late, as the late tier promises.
    A class whose late requests are shed is refused by its target. The machine factor the cost model
    learned is what predicts it (and what /load reports)."""
    from engine.core.engine import Engine as _Engine
    from engine.core.request import Request as _Request
    from engine.model.cost import SeqSpan

    eng = _Engine(EngineConfig())  # not started
    try:
        n = 3000
        cost = eng.scheduler.cost
        for _ in range(3):  # confirmed: predictions are refused on as they stand
            cost.observe(n, 1.0, 1.0)
        predicted = cost.prefill_s([SeqSpan(0, n)])

        def req(target_s: float, late_s: float, shed_late: bool = False) -> _Request:
            return _Request(request_id="r", prompt_token_ids=[65] * n, ttft_target_s=target_s, late_s=late_s,
                            shed_late=shed_late)

        assert eng.admission([req(predicted / 2, predicted)], sheddable=True) is None  # late, within its bound
        assert eng.admission([req(predicted / 2, predicted, shed_late=True)], sheddable=True).reason == \
            "predicted_slo_miss"
        assert eng.admission([req(predicted / 4, predicted / 4)], sheddable=True).reason == "predicted_slo_miss"
        for _ in range(3):  # each size's own way, on the quiet machine
            for tokens in (100, 1000):
                cost.observe(tokens, 0.1, 0.1)
        for _ in range(3):  # then a machine 3x slower, measured by batches of every size
            for tokens in (100, 1000, n):
                cost.observe(tokens, 0.1, 0.3)
        eng.call(lambda: eng._publish(full=True))  # as the engine thread does after each event
        assert 2.5 < eng.load().machine_factor < 3.3
        refusal = eng.admission([req(predicted / 2, predicted)], sheddable=True)  # 3x its prediction: hopeless
        assert refusal is not None and "x the calibrated time" in refusal.message, refusal
    finally:
        eng.shutdown()


def test_the_model_device_becomes_the_threads_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA events, synchronize and graph capture act on the current device: a model on cuda:1 makes
    cuda:1 current for the thread that loads it and for the engine thread (no GPU needed to check)."""
    import torch

    from engine.model import use_device

    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for name in ("cpu", "cuda", "cuda:1"):
        use_device(torch.device(name))
    assert calls == [torch.device("cuda:1")]  # plain "cuda" is the current device already


def test_each_batch_records_its_host_gap(make_engine: Callable[..., Engine]) -> None:
    """The host gap (the device idle while a batch's work waited: from the last step's end, or its first
    request's arrival, to its first step) is recorded per batch and summarised for the benchmarks."""
    from engine.core.batch_log import host_gaps_ms
    from engine.sim.oracle import BatchCostRecorder

    eng = make_engine("fcfs", start=False)
    recorder = BatchCostRecorder()
    eng.observers.append(recorder)
    eng.start()
    for i in range(3):  # one at a time: each batch waits for the idle engine to wake, decide and form it
        eng.generate([[65 + i] * 40], SamplingParams(max_tokens=2), timeout_s=60)
    gaps = [b.host_gap_s for b in recorder.batches]
    assert len(gaps) == 3 and all(g is not None and 0.0 <= g < 1.0 for g in gaps), gaps
    summary = host_gaps_ms(recorder.batches)
    assert summary is not None and summary["batches"] == 3 and 0.0 <= summary["p50"] <= summary["p99"] < 1000.0
    # the cost model learns the host's time per batch from them, and predictions add it once per batch
    assert 0.0 < eng.call(lambda: eng.cost.batch_host_s) <= max(gaps)


def test_a_short_queue_is_predicted_again_only_when_it_or_the_cost_model_moved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot is refreshed every few milliseconds while a batch runs; a short queue's predictions are
    remade only when a decision or the cost model's correction moved (a periodic remake made a publish 2-4x
    longer with 5-15 waiting), and what it reports stays exact."""
    from engine.core.engine import Engine as _Engine
    from engine.core.request import Request as _Request
    from engine.core.scheduler import Scheduler

    eng = _Engine(EngineConfig())  # not started: `call` runs here, as the owner
    try:
        s = eng.scheduler
        predicted: list[str] = []
        real = Scheduler.predict_s
        monkeypatch.setattr(Scheduler, "predict_s", lambda self, r: predicted.append(r.request_id) or real(self, r))
        reqs = [_Request(request_id=f"r{i}", prompt_token_ids=[65] * (100 * (i + 1))) for i in range(3)]
        eng.call(lambda: s.waiting.extend(reqs))
        eng.call(eng._publish)
        assert sorted(predicted) == ["r0", "r1", "r2"]
        backlog = eng.load().predicted_backlog_s
        assert backlog == pytest.approx(sum(real(s, r) for r in reqs))
        predicted.clear()
        for _ in range(3):  # periodic refreshes, nothing moved
            eng.call(eng._publish)
        assert predicted == [] and eng.load().predicted_backlog_s == backlog
        eng.call(lambda: s.cost.observe(100, 0.1, 0.3))  # the correction learned: predictions move
        eng.call(eng._publish)
        assert sorted(predicted) == ["r0", "r1", "r2"] and eng.load().predicted_backlog_s > backlog
        predicted.clear()
        eng.call(lambda: s.waiting.remove(reqs[0]))  # the queue moved
        eng.call(eng._publish)
        assert sorted(predicted) == ["r1", "r2"]
    finally:
        eng.shutdown()
