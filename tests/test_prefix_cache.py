"""Automatic prefix caching (engine/core/kv_cache.py BlockPool, the engine's use of it).

The pool's bookkeeping first (references, eviction order, content hashes), then the engine on the
embedded model: a request whose prompt starts with cached blocks computes only the rest and produces
exactly what it produces with caching off, multi-turn prompts find the previous answer's blocks, and
every path (finish, cancel while waiting, eviction under pressure) leaves the pool whole.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import EngineFactory
from test_engine import Sink, assert_idle_and_free, tokens

from engine.core.engine import Engine
from engine.core.kv_cache import BlockPool, block_hashes
from engine.core.request import Request, SamplingParams

BS = 16


def test_hashes_name_the_whole_prefix() -> None:
    a = block_hashes(list(range(50)), BS)
    assert len(a) == 3  # full blocks only
    assert block_hashes([*range(48), 7, 7], BS) == a  # the partial block is not hashed
    b = block_hashes([99, *range(1, 50)], BS)
    assert all(x != y for x, y in zip(a, b, strict=True))  # one token differs: every later block differs
    assert block_hashes(list(range(70)), BS, prev=a) == block_hashes(list(range(70)), BS)  # extended


def test_pool_references_eviction_and_reuse() -> None:
    pool = BlockPool(BS, 6 * BS)
    hashes = block_hashes(list(range(3 * BS)), BS)
    owner = pool.allocate_blocks(4)
    ids = list(owner)  # free() empties the table it is given
    pool.register(owner, hashes)
    assert pool.cached_prefix(hashes) == 3 and pool.num_cached_blocks == 3
    shared = pool.acquire_prefix(hashes[:2])
    assert shared == ids[:2] and pool.num_free_blocks == 2  # referenced twice, not free
    pool.free(owner)
    assert pool.num_free_blocks == 4  # owner's 3rd and 4th blocks free; the two shared held
    pool.free(shared)
    assert pool.num_free_blocks == 6 and pool.cached_prefix(hashes) == 3  # free, still findable
    # Reuse takes never-used and oldest-freed blocks first; a finished table is freed tail first,
    # so the prefix's head is evicted last.
    taken = pool.allocate_blocks(3)
    assert pool.cached_prefix(hashes) == 3 and ids[3] in taken  # the unregistered 4th went first
    taken += pool.allocate_blocks(1)
    assert pool.cached_prefix(hashes) == 2 and ids[2] in taken
    taken += pool.allocate_blocks(1)
    assert pool.cached_prefix(hashes) == 1
    pool.free(taken)
    assert pool.acquire_prefix(hashes) == ids[:1]
    # A block whose content another block already holds stays private.
    other = pool.allocate_blocks(1)
    pool.register(other, hashes[:1])
    assert pool.acquire_prefix(hashes[:1]) == ids[:1]


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_block_size=BS, kv_capacity_tokens=64 * BS)
    yield factory
    factory.close()


def run(eng: Engine, rid: str, prompt: list[int], max_tokens: int = 8) -> tuple[Request, Sink]:
    req = Request(request_id=rid, prompt_token_ids=prompt,
                  sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sink = Sink(req)
    req.sink = sink
    eng.add_request(req)
    assert sink.done.wait(60) and req.finish_reason == "length"
    return req, sink


def test_a_cached_prefix_is_not_recomputed_and_changes_nothing(make_engine: EngineFactory) -> None:
    cached, plain = make_engine(), make_engine(prefix_caching=False)
    prompt = tokens(90, seed=1)
    first, _ = run(cached, "a", prompt)
    assert first.cached_tokens == 0
    again, _ = run(cached, "b", prompt)
    assert again.cached_tokens == 80  # 5 full blocks; the one holding the last token is computed
    follow = [*prompt, *first.output_token_ids, *tokens(20, seed=2)]  # the next turn of a conversation
    turn, _ = run(cached, "c", follow)
    # prompt + answer but its last token (never fed back) = 97 tokens: 6 blocks, one past the prompt's
    assert turn.cached_tokens == 96
    other, _ = run(cached, "d", tokens(90, seed=3))
    assert other.cached_tokens == 0
    for req in (again, turn, other):
        ref, _ = run(plain, f"ref-{req.request_id}", req.prompt_token_ids)
        assert req.output_token_ids == ref.output_token_ids, req.request_id
        assert ref.cached_tokens == 0
    assert_idle_and_free(cached)
    assert cached.kv.num_cached_blocks > 0  # free, and still findable


def test_a_cancelled_batch_returns_its_prefix_blocks(make_engine: EngineFactory) -> None:
    """Chosen at arrival (the scheduler decides on the event), the batch takes the cached blocks and
    one more; cancelled before it runs, every reference comes back."""
    eng = make_engine(start=False)
    prompt = tokens(70, seed=4)
    eng.start()
    run(eng, "warm", prompt)
    eng.shutdown()
    eng2 = make_engine(start=False)  # not started: the batch waits to run
    eng2.kv = eng2.scheduler.kv = eng2.prefixes.pool = eng.kv
    req = Request(request_id="w", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2))
    done = threading.Event()
    req.sink = lambda out: out.finish_reason and done.set()
    eng2.add_request(req)
    eng2._take_inbox()  # not started: this thread takes the arrival, as the engine thread would
    # its 4 cached blocks (the 5th holds the last prompt token) and one more for the rest
    assert req.cached_tokens == 64 and len(req.block_table) == 5 and eng2.scheduler.chosen is not None
    assert eng2.kv.num_free_blocks == eng2.kv.num_blocks - 5  # held by the batch: not evictable
    eng2.cancel("w")
    eng2.start()
    assert done.wait(10) and req.finish_reason == "cancelled"
    assert_idle_and_free(eng2)


def test_eviction_under_pressure_keeps_results_exact(make_engine: EngineFactory) -> None:
    """A pool of 12 blocks: later prompts evict the first one's blocks; it is computed again."""
    eng, plain = make_engine(kv_capacity_tokens=12 * BS), make_engine(prefix_caching=False)
    prompt = tokens(100, seed=5)
    first, _ = run(eng, "p1", prompt)
    for i in range(3):
        run(eng, f"fill{i}", tokens(150, seed=10 + i))
    again, _ = run(eng, "p2", prompt)
    assert again.cached_tokens < first.num_prompt_tokens - BS  # some or all of it was evicted
    assert again.output_token_ids == run(plain, "ref", prompt)[0].output_token_ids
    assert_idle_and_free(eng)


def test_admission_counts_the_cached_prefix(make_engine: EngineFactory) -> None:
    """A sheddable request too long for its TTFT target is admitted when most of it is cached."""
    eng = make_engine(kv_capacity_tokens=4096)
    prompt = tokens(1500, seed=6)
    run(eng, "warm", prompt, max_tokens=1)
    target = eng.scheduler.predict_s(Request(request_id="x", prompt_token_ids=prompt)) / 4
    for rid, ids, refused in (("cold", tokens(1500, seed=7), "predicted_slo_miss"), ("hot", prompt, None)):
        req = Request(request_id=rid, prompt_token_ids=ids, ttft_target_s=target, late_s=0.0)
        refusal = eng.admission([req], sheddable=True)
        assert (refusal and refusal.reason) == refused, rid


def test_the_benchmark_runs_and_reports(tmp_path: Path) -> None:
    from engine.bench import prefix_cache

    out, threads = tmp_path / "bench", torch.get_num_threads()
    try:
        assert prefix_cache.main(["--conversations", "2", "--turns", "2", "--system-tokens", "300", "--user-tokens",
                                  "40", "--answer-tokens", "4", "--kv-block-size", "16", "--threads", "1",
                                  "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((out / "prefix_cache.json").read_text())
    rows = results["turns"]
    assert [r["turn"] for r in rows] == [1, 2] and all(r["same_tokens"] for r in rows)
    assert rows[1]["cached_share"] > 0.8  # the second turn finds the system prompt and the first turn
    assert (out / "prefix_cache.png").stat().st_size > 10_000


def test_waiting_requests_hold_no_blocks_so_the_first_in_line_always_fits(make_engine: EngineFactory) -> None:
    """Two cached prefixes of 4 blocks, a pool of 16 blocks with 6 in use elsewhere, and two requests
    of 13 blocks each, one per prefix: they wait. Had each held its 4 cached blocks while waiting,
    freeing the 6 would leave 8 free blocks for requests needing 9 more each: neither would ever run.
    (Their answers' KV is reserved up front here, so that they need 13 blocks each.)"""
    eng = make_engine(kv_capacity_tokens=16 * BS, kv_reservation="full")
    p1, p2 = tokens(65, seed=20), tokens(65, seed=21)
    run(eng, "p1", p1, max_tokens=1)
    run(eng, "p2", p2, max_tokens=1)
    held = eng.call(lambda: eng.kv.allocate_blocks(6))  # another request's KV: the never-used blocks, nothing evicted
    waiting = []
    for rid, prompt in (("a", p1), ("b", p2)):
        req = Request(request_id=rid, prompt_token_ids=prompt,
                      sampling=SamplingParams(max_tokens=130, temperature=0.0, ignore_eos=True))
        sink = Sink(req)
        req.sink = sink
        eng.add_request(req)
        eng.call(lambda: None)  # once the engine thread has taken the arrival
        assert req.cached_tokens == 64 and req.block_table == []  # found, not taken
        waiting.append((req, sink))
    assert eng.num_waiting == 2
    eng.call(lambda: eng._free_blocks(held))  # what the engine does when that request ends
    for req, sink in waiting:
        assert sink.done.wait(60) and req.finish_reason == "length", req.request_id
    assert_idle_and_free(eng)


def test_a_prefix_evicted_while_its_request_waits_is_computed(make_engine: EngineFactory) -> None:
    eng, plain = make_engine(kv_capacity_tokens=16 * BS, kv_reservation="full"), make_engine(prefix_caching=False)
    prompt = tokens(70, seed=30)
    run(eng, "warm", prompt, max_tokens=1)
    held = eng.call(lambda: eng.kv.allocate_blocks(eng.kv.num_free_blocks - 5))  # only the cached prompt: free
    req = Request(request_id="r", prompt_token_ids=prompt,
                  sampling=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))  # 7 blocks: waits
    sink = Sink(req)
    req.sink = sink
    eng.add_request(req)
    eng.call(lambda: None)  # once the engine thread has taken the arrival
    assert req.cached_tokens == 64 and eng.num_waiting == 1
    evicted = eng.call(lambda: eng.kv.allocate_blocks(5))  # evicts them, and overwrites them
    for t in (*eng.kv.k, *eng.kv.v):
        t[evicted] = float("nan")
    held += evicted
    eng.call(lambda: eng._free_blocks(held))
    assert sink.done.wait(30) and req.finish_reason == "length"
    assert req.cached_tokens == 0  # found at arrival, gone when its batch formed: all 70 computed
    assert req.output_token_ids == run(plain, "ref", prompt, max_tokens=40)[0].output_token_ids
    assert_idle_and_free(eng)


@pytest.mark.parametrize("policy", ["flowprefill", "chunked:64", "fcfs"])
def test_concurrent_shared_prefixes_with_cancels_stay_exact_and_leak_nothing(make_engine: EngineFactory,
                                                                           policy: str) -> None:
    """Requests built from three shared prefixes arrive together, in chunks and preempting each other
    (flowprefill), some cancelled at random moments: every one ends, each finished one has the tokens
    an uncached engine gives its prompt, and the pool is whole at the end."""
    import random

    rng = random.Random(policy)
    eng, plain = make_engine(policy), make_engine(prefix_caching=False)
    prefixes = [tokens(rng.choice((40, 70, 130)), seed=100 + i) for i in range(3)]
    for i, prefix in enumerate(prefixes[:2]):  # two of the prefixes are cached before the crowd comes
        run(eng, f"warm{i}", [*prefix, 1], max_tokens=1)
    reqs, sinks = [], []
    for i in range(12):
        prompt = [*rng.choice(prefixes), *tokens(rng.randrange(1, 60), seed=200 + i)]
        req = Request(request_id=f"s{i}", prompt_token_ids=prompt, ttft_target_s=rng.choice((0.05, 5.0)),
                      sampling=SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True))
        sink = Sink(req)
        req.sink = sink
        eng.add_request(req)
        reqs.append(req)
        sinks.append(sink)
        if rng.random() < 0.25:
            eng.cancel(f"s{rng.randrange(i + 1)}")
    for req, sink in zip(reqs, sinks, strict=True):
        assert sink.done.wait(60), req.request_id
        assert req.finish_reason in ("length", "cancelled"), (req.request_id, req.finish_reason)
        assert 0 <= req.cached_tokens < req.num_prompt_tokens
    finished = [r for r in reqs if r.finish_reason == "length"]
    assert finished and any(r.cached_tokens for r in finished)
    for req in finished:
        ref, _ = run(plain, f"ref-{req.request_id}", req.prompt_token_ids, max_tokens=req.sampling.max_tokens)
        assert req.output_token_ids == ref.output_token_ids, req.request_id
    assert_idle_and_free(eng)
