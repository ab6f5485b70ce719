"""Completions' `echo` (the prompt given back before the completion) and, with `logprobs`, the prompt
tokens' log-probabilities: what evaluation harnesses read to score a continuation
(lm-evaluation-harness' local-completions sends echo, logprobs 1, max_tokens 1 and sums
`token_logprobs[ctxlen:-1]`). The model-level values are checked against transformers in
test_reference.py; here, the API's shapes and what the engine does around them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from helpers import EngineFactory, module_engine
from test_engine import Sink, assert_idle_and_free

import engine.core.prefill as prefill_module
from engine.core.engine import Engine
from engine.core.observer import EngineObserver
from engine.core.request import Request, SamplingParams
from engine.model.cost import SeqSpan
from engine.model.plan import plan_prefill
from engine.serving.worker import create_worker_app


@pytest.fixture(scope="module")
def worker(torch_single_thread: None) -> Iterator[tuple[Engine, Any]]:
    with module_engine(kv_capacity_tokens=16384, kv_block_size=16) as eng:
        yield eng, create_worker_app(eng, "m")


def post(app: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post("/v1/completions", json=body, headers=headers or {})
    return asyncio.run(asyncio.wait_for(go(), 60))


def full_forward_logprobs(eng: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits, from one unsplit forward of the whole prompt (on the
    engine thread, which owns the KV cache)."""
    return eng.call(lambda: _full_forward_logprobs(eng, ids))


def _full_forward_logprobs(eng: Engine, ids: list[int]) -> torch.Tensor:
    table = eng.kv.allocate(len(ids))
    try:
        run = eng.model.prefill([ids], [SeqSpan(0, len(ids))], [table], eng.kv,
                                plan_prefill(eng.cost, [SeqSpan(0, len(ids))], None), all_logits=True)
        while True:
            next(run)
    except StopIteration as stop:
        return torch.log_softmax(stop.value.float(), -1)
    finally:
        eng.kv.free(table)


def test_what_an_evaluation_harness_reads(worker: tuple[Engine, Any]) -> None:
    eng, app = worker
    context, continuation = "The capital of France is", " Paris"
    ids = eng.tokenizer.encode(context + continuation)
    body = {"prompt": context + continuation, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    choice = post(app, body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(context + continuation) and len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][:3] == [0, 1, 2]
    want = full_forward_logprobs(eng, ids)
    ctxlen = len(eng.tokenizer.encode(context))
    score = sum(lp["token_logprobs"][ctxlen:-1])  # the harness' sum over the continuation
    assert score == pytest.approx(sum(float(want[p - 1, ids[p]]) for p in range(ctxlen, len(ids))), abs=1e-3)
    for p in range(1, len(ids)):  # each top holds the likeliest token and the prompt's own
        top = lp["top_logprobs"][p]
        assert lp["token_logprobs"][p] in top.values() and max(top.values()) == pytest.approx(
            float(want[p - 1].max()), abs=1e-4)
    assert_idle_and_free(eng)


def test_echo_alone_uses_the_prefix_cache_and_logprobs_do_not(worker: tuple[Engine, Any]) -> None:
    _, app = worker
    prompt = "A prompt long enough to fill a few cache blocks of sixteen tokens. " * 2
    first = post(app, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}).json()
    again = post(app, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # no logprobs: cached as ever
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert again["choices"][0]["text"].startswith(prompt) and again["choices"][0]["logprobs"] is None
    scored = post(app, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0}).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # every position computed
    assert scored["choices"][0]["text"] == again["choices"][0]["text"]
    plain = post(app, {"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()["choices"][0]["text"]
    assert again["choices"][0]["text"] == prompt + plain


def test_token_prompts_streams_and_choices(worker: tuple[Engine, Any]) -> None:
    eng, app = worker
    ids = eng.tokenizer.encode("Hello there")
    whole = post(app, {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2})
    text = whole.json()["choices"][0]["text"]
    assert text.startswith("Hello there")  # token ids echo as their text

    async def stream() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return (await c.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                           "echo": True, "logprobs": 2, "stream": True})).text
    events = [json.loads(line[6:]) for line in asyncio.run(stream()).splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == text
    assert events[0]["choices"][0]["text"].startswith("Hello there")  # the prompt comes with the first token
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole.json()["choices"][0]["logprobs"]["token_logprobs"]
    two = post(app, {"prompt": "Hi", "max_tokens": 2, "temperature": 0.9, "seed": 1, "echo": True, "logprobs": 1,
                     "n": 2}).json()["choices"]
    first, second = (c["logprobs"]["token_logprobs"][:2] for c in two)
    assert first == second  # each choice scored the same prompt
    one = post(app, {"prompt": [65], "max_tokens": 1, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert one["logprobs"]["token_logprobs"][0] is None and len(one["logprobs"]["tokens"]) == 2


def test_not_with_disaggregation(worker: tuple[Engine, Any]) -> None:
    eng, _ = worker
    prefill = create_worker_app(eng, "m", role="prefill")
    r = post(prefill, {"prompt": "x", "max_tokens": 1, "echo": True, "logprobs": 1},
             headers={"x-flowprefill-kv-to": "http://127.0.0.1:1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_a_scored_prompt_is_cached_for_others(worker: tuple[Engine, Any]) -> None:
    eng, app = worker
    prompt = "Another prompt, written to be cached once it has been scored: sixteen tokens a block. " * 2
    scored = post(app, {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}).json()
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = post(app, {"prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its blocks, registered as usual
    (one,) = eng.generate([[65]], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert one.prompt_token_logprobs == [None]  # one entry per prompt token, as for longer prompts


def test_a_request_whose_scoring_fails_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring runs after the batch's steps (out of memory on a large vocabulary, say): the request
    fails, the plain request batched with it is served, and every block comes back."""
    def broken(*args: object, **kw: object) -> list:
        raise RuntimeError("out of memory")
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=4096, kv_block_size=16)
    try:
        eng = factory("fcfs", start=False)
        monkeypatch.setattr(prefill_module, "prompt_logprobs", broken)
        batches: list[list[str]] = []

        class Batches(EngineObserver):
            def on_segment_start(self, batch: Any, now: float) -> None:
                batches.append([r.request_id for r in batch.requests])
        eng.observers.append(Batches())
        sinks = {}
        for rid, n, k in (("busy", 300, None), ("scored", 50, 1), ("plain", 55, None)):
            r = Request(request_id=rid, prompt_token_ids=list(range(40, 40 + n)),
                        sampling=SamplingParams(max_tokens=2, prompt_logprobs=k, ignore_eos=True))
            r.sink = sinks[rid] = Sink(r)
            eng.add_request(r)  # fcfs: "busy" runs first, the other two wait and form one batch
        eng.start()
        assert sinks["scored"].wait() == "error" and "prompt logprobs failed" in sinks["scored"].outputs[-1].error
        assert sinks["plain"].wait() == sinks["busy"].wait() == "length"
        assert ["scored", "plain"] in batches
        assert_idle_and_free(eng)
    finally:
        factory.close()


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(worker: tuple[Engine, Any]) -> None:
    """OpenAI's legacy API (and HELM, and older harnesses) score a prompt with echo and max_tokens 0."""
    eng, app = worker
    one = post(app, {"prompt": "Score me", "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}).json()
    zero = post(app, {"prompt": "Score me", "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = zero["choices"][0]
    assert choice["text"] == "Score me" and choice["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"] == one["choices"][0]["logprobs"]["token_logprobs"][:-1]

    async def stream() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return (await c.post("/v1/completions", json={"prompt": "Score me", "max_tokens": 0, "echo": True,
                                                           "stream": True})).text
    events = [json.loads(line[6:]) for line in asyncio.run(stream()).splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events] == ["Score me"]
    for body in ({"prompt": "x", "max_tokens": 0}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}):
        r = post(app, body) if "prompt" in body else _chat(app, body)
        assert r.status_code == 400 and "0 only with echo" in r.json()["error"]["message"]
    assert_idle_and_free(eng)


def _chat(app: Any, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post("/v1/chat/completions", json=body)
    return asyncio.run(asyncio.wait_for(go(), 60))


def test_batched_prompts(worker: tuple[Engine, Any]) -> None:
    """OpenAI's batched form (a list of prompts, as lm-evaluation-harness sends with batch_size > 1):
    each prompt is its own completion, n choices each, indexed prompt by prompt; each answer equals the
    prompt's alone, usage adds the prompts up."""
    eng, app = worker
    texts = ["First prompt", "The second one", "Third"]
    batched = post(app, {"prompt": texts, "max_tokens": 4, "temperature": 0.8, "seed": 5, "n": 2, "echo": True,
                         "logprobs": 1})
    assert batched.status_code == 200, batched.text
    body = batched.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    alone = [post(app, {"prompt": t, "max_tokens": 4, "temperature": 0.8, "seed": 5, "n": 2, "echo": True,
                        "logprobs": 1}).json() for t in texts]
    for p, one in enumerate(alone):
        for j in range(2):
            got, want = body["choices"][2 * p + j], one["choices"][j]
            assert got["text"] == want["text"] and got["text"].startswith(texts[p])
            assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert body["usage"]["completion_tokens"] == 3 * 2 * 4
    ids = [eng.tokenizer.encode(t) for t in texts]
    as_ids = post(app, {"prompt": ids, "max_tokens": 4, "temperature": 0}).json()["choices"]
    as_text = post(app, {"prompt": texts, "max_tokens": 4, "temperature": 0}).json()["choices"]
    assert [c["text"] for c in as_ids] == [c["text"] for c in as_text]
    for bad in ([], [[]], ["ok", 5], [["x"]]):
        r = post(app, {"prompt": bad, "max_tokens": 2})
        assert r.status_code == 400, (bad, r.text)
    assert_idle_and_free(eng)


def test_a_prompt_that_fills_the_cache_is_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_tokens 0 writes no first token: a prompt of the whole cache's size fits (grow reservation
    took a block more, and waited for it forever)."""
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=512, kv_block_size=16)
    try:
        eng = factory("fcfs")
        (scored,) = eng.generate([[i % 250 + 1 for i in range(512)]], SamplingParams(max_tokens=0, prompt_logprobs=0))
        assert scored.finish_reason == "length" and len(scored.prompt_token_logprobs) == 512
        (after,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert after.finish_reason == "length"
        assert_idle_and_free(eng)
    finally:
        factory.close()


def test_echoed_token_ids_out_of_the_vocabulary_are_a_400(worker: tuple[Engine, Any]) -> None:
    _, app = worker
    for prompt in ([[5, 6], [7, -1]], [5, 2**70], [[5, 6], [7, 10**9]]):
        r = post(app, {"prompt": prompt, "max_tokens": 1, "echo": True})
        assert r.status_code == 400, (prompt, r.text)


def test_vllms_prompt_logprobs(worker: tuple[Engine, Any]) -> None:
    """vLLM's `prompt_logprobs` (completions per choice, chat at the top): by token id, the prompt
    token's logprob and rank and the k likeliest's, the same numbers echo gives."""
    eng, app = worker
    echo = post(app, {"prompt": "Rank these", "max_tokens": 1, "echo": True, "logprobs": 0}).json()["choices"][0]
    got = post(app, {"prompt": "Rank these", "max_tokens": 1, "prompt_logprobs": 2}).json()["choices"][0]
    ids = eng.tokenizer.encode("Rank these")
    entries = got["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None and got["logprobs"] is None
    for p, (entry, lp) in enumerate(zip(entries[1:], echo["logprobs"]["token_logprobs"][1:len(ids)], strict=True), 1):
        mine = entry[str(ids[p])]
        assert mine["logprob"] == pytest.approx(lp, abs=1e-5) and mine["rank"] >= 1
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and best["logprob"] >= mine["logprob"] and 2 <= len(entry) <= 3
    chat = _chat(app, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    body = chat.json()
    assert chat.status_code == 200 and body["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])  # k=0: the prompt token alone

    async def stream() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return (await c.post("/v1/completions", json={"prompt": "Rank these", "max_tokens": 2,  # two events:
                                                           "ignore_eos": True,  # sampled, EOS may come first
                                                           "prompt_logprobs": 2, "stream": True})).text
    events = [json.loads(line[6:]) for line in asyncio.run(stream()).splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["prompt_logprobs"] == entries and "prompt_logprobs" not in events[1]["choices"][0]
