"""Prefill/decode disaggregation: the KV a prefill worker hands off decodes, on another worker, to
exactly what one worker alone produces."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import EngineFactory
from processes import answers, free_port, start, stop, wait_healthy
from safetensors.torch import save

from engine.core import handoff
from engine.core.engine import Engine
from engine.core.request import Request, Sampled, SamplingParams
from engine.protocol.headers import KV_SHM_HEADER
from engine.serving import kv_transport
from engine.serving.structured_output import Grammars, Guide, GuidedAnswer

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(torch_single_thread: None) -> Iterator[tuple[Engine, Engine]]:
    mp = pytest.MonkeyPatch()
    factory = EngineFactory(mp, kv_capacity_tokens=16384, kv_block_size=64)
    try:
        yield factory(), factory()
    finally:
        factory.close()
        mp.undo()


def _run(eng: Engine, req: Request, add: object = None) -> Request:
    done = threading.Event()
    req.sink = lambda out: out.finish_reason and done.set()
    (add or eng.add_request)(req)  # type: ignore[operator]
    assert done.wait(60)
    return req


def test_handoff_decodes_like_one_worker(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    prompt = [(11 * i + 3) % 250 + 1 for i in range(700)]
    (alone,) = prefill.generate([prompt], GREEDY)
    exported: dict[str, torch.Tensor] = {}  # the prompt's KV, given at its first token
    first = _run(prefill, Request(request_id="p", prompt_token_ids=prompt, kv_sink=exported.update,
                                  sampling=SamplingParams(max_tokens=1, temperature=0)))
    assert exported and first.block_table == []  # its KV went back to the pool
    kv, token = handoff.unpack(handoff.pack(exported, Sampled(first.output_token_ids[0])))
    assert set(kv) == {f"{k}.{i}" for k in "kv" for i in range(prefill.model.cfg.num_hidden_layers)}
    free_before = decode.kv.num_free_blocks
    req = Request(request_id="d", prompt_token_ids=prompt, sampling=GREEDY)
    _run(decode, req, lambda r: decode.add_prefilled(r, kv, token))
    assert req.output_token_ids == alone.output_token_ids
    assert decode.kv.num_free_blocks == free_before  # and its blocks came back


def test_a_handoff_waits_for_kv_blocks_instead_of_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode worker whose cache is held by running answers queues a handed-off request until
    blocks come back; one cancelled while it waits leaves the queue to the next."""
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=1024, kv_block_size=64)
    try:
        decode = factory()
        cfg = decode.model.cfg
        prompt = [5] * 100
        kv = {f"{k}.{i}": torch.zeros(100, cfg.num_key_value_heads, cfg.head_dim)
              for k in "kv" for i in range(cfg.num_hidden_layers)}
        held = decode.call(lambda: decode.kv.allocate_blocks(decode.kv.num_free_blocks - 1))  # running answers' KV
        outs: dict[str, list[str | None]] = {}
        reqs = []
        for rid in ("wait", "gone", "next"):
            req = Request(request_id=rid, prompt_token_ids=prompt,
                          sampling=SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
            outs[rid] = []
            req.sink = lambda out, rid=rid: outs[rid].append(out.finish_reason)
            decode.add_prefilled(req, kv, Sampled(7))  # its prompt and first token: 2 blocks, 1 free
            reqs.append(req)
        decode.cancel("gone")
        time.sleep(0.3)
        assert outs["wait"] == [] and outs["gone"] == ["cancelled"] and outs["next"] == []  # none failed
        decode.call(lambda: decode._free_blocks(held))
        for req in (reqs[0], reqs[2]):
            deadline = time.monotonic() + 30
            while req.finish_reason is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert req.finish_reason == "length" and len(req.output_token_ids) == 100
        assert decode.kv.num_free_blocks == decode.kv.num_blocks
    finally:
        factory.close()


def test_handoff_rejects_kv_of_another_shape(engines: tuple[Engine, Engine]) -> None:
    _, decode = engines
    bad = {f"{k}.{i}": torch.zeros(5, 2, 32) for k in "kv" for i in range(decode.model.cfg.num_hidden_layers)}
    with pytest.raises(ValueError, match=r"expected shape \(6, 2, 32\)"):
        decode.add_prefilled(Request(request_id="x", prompt_token_ids=[1] * 6), bad, Sampled(7))
    with pytest.raises(ValueError, match="no first_token"):
        handoff.unpack(save({"k.0": torch.zeros(1)}))


def test_inbox_waits_and_expires() -> None:
    async def main() -> None:
        inbox = kv_transport.KVInbox(ttl_s=0.0)
        waiter = asyncio.ensure_future(inbox.take("a", 5))
        await asyncio.sleep(0)
        inbox.put("a", {}, Sampled(3))
        assert await waiter == ({}, Sampled(3))
        with pytest.raises(TimeoutError):
            await inbox.take("never", 0.05)
        inbox.put("stale", {}, Sampled(1))
        inbox.put("fresh", {}, Sampled(2))  # putting expires what nobody claimed within the TTL
        assert len(inbox) == 1

    asyncio.run(main())


@pytest.fixture(scope="module")
def disaggregated() -> Iterator[int]:
    port = free_port(span=3)
    proc = start("serve", "--model", "tiny", "--workers", "2", "--disaggregate", "--port", str(port), "--threads", "1",
                 "--kv-capacity-tokens", "32768")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield port
    finally:
        stop(proc)


@pytest.mark.slow
def test_served_disaggregated_matches_one_worker(disaggregated: int, engines: tuple[Engine, Engine]) -> None:
    port = disaggregated
    health = httpx.get(f"http://127.0.0.1:{port}/health").json()
    assert len(health["workers"]) == 2 and all(health["workers"].values())
    roles = [httpx.get(f"http://127.0.0.1:{port + i}/health").json()["role"] for i in (1, 2)]
    assert roles == ["prefill", "decode"]
    prompt = "A long document about scheduling. " * 40
    # one engine alone (no hand-off): the reference
    eng = engines[0]
    (alone,) = eng.generate([eng.tokenizer.encode(prompt)], SamplingParams(max_tokens=10, temperature=0,
                                                                           ignore_eos=True))
    ref = eng.tokenizer.decode(alone.output_token_ids)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    got = client.completions.create(model="flowprefill-default", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True}, extra_headers={"x-slo-class": "interactive"})
    assert got.choices[0].text == ref
    streamed = client.completions.create(model="flowprefill-default", prompt=prompt, max_tokens=10, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == ref
    # logprobs: the first token's come from the prefill worker with its KV, the rest from the decode worker
    third = client.completions.create(model="flowprefill-default", prompt=prompt, max_tokens=10, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})
    lp = third.choices[0].logprobs
    # the prefill worker found the prompt's 5 full blocks cached; the decode worker reports it
    assert third.usage.prompt_tokens_details.cached_tokens == 1280 > got.usage.prompt_tokens_details.cached_tokens
    assert len(lp.token_logprobs) == 10
    assert all(top == {tok: pytest.approx(p)} for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                                        strict=True))  # greedy: the likeliest
    # structured output: the prefill worker's first token is constrained, and the decode worker's
    # matcher follows it before constraining the rest
    regex = "[a-z]{3}( [a-z]{2,5}){3}"
    ref_req = Request(request_id="guided", prompt_token_ids=eng.tokenizer.encode(prompt),
                      sampling=SamplingParams(max_tokens=30, temperature=0, guide=Guide("regex", regex)))
    ref_req.constraint = GuidedAnswer(Grammars(eng.tokenizer, eng.model.cfg.vocab_size).matcher(ref_req.sampling.guide))
    want = eng.tokenizer.decode(_run(eng, ref_req).output_token_ids)
    guided = client.completions.create(model="flowprefill-default", prompt=prompt, max_tokens=30, temperature=0,
                                       extra_body={"guided_regex": regex})
    assert guided.choices[0].text == want and guided.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, want)
    # the prefill worker did prefill only: its KV went to the decode worker, nothing is left behind
    pre = httpx.get(f"http://127.0.0.1:{port + 1}/load").json()
    dec = httpx.get(f"http://127.0.0.1:{port + 2}/load").json()
    assert pre["kv_cache_usage"] == 0 and dec["kv_cache_usage"] == 0


@pytest.mark.slow
def test_served_disaggregated_responses_and_tokenize(disaggregated: int, engines: tuple[Engine, Engine]) -> None:
    """The Responses API splits as chat does: the prefill worker's first token and KV, the rest
    decoded on the other; whole and streamed, the answer one worker alone gives. Tokenize goes to
    any worker."""
    eng = engines[0]
    messages = [{"role": "user", "content": "Summarize: " + "a long document about scheduling. " * 30}]
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(messages))
    (alone,) = eng.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{disaggregated}/v1", api_key="x", max_retries=0)
    body = {"model": "flowprefill-default", "input": messages, "max_output_tokens": 8, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    got = client.responses.create(**body)  # type: ignore[call-overload]
    assert got.output_text == eng.tokenizer.decode(alone.output_token_ids) and got.usage.input_tokens == len(ids)
    events = list(client.responses.create(stream=True, **body))  # type: ignore[call-overload]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == got.output_text
    counted = httpx.post(f"http://127.0.0.1:{disaggregated}/tokenize", json={"messages": messages}).json()
    assert counted["tokens"] == ids
    for worker in (disaggregated + 1, disaggregated + 2):  # nothing left held
        assert httpx.get(f"http://127.0.0.1:{worker}/load").json()["kv_cache_usage"] == 0


@pytest.mark.slow
def test_workers_refuse_requests_outside_their_role(disaggregated: int) -> None:
    for port, header in ((disaggregated + 1, "x-flowprefill-kv-to"), (disaggregated + 2, "x-flowprefill-kv-id")):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 421 and header in r.json()["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/load").json()["waiting"] == 0
    # what the halves cannot split is refused by the prefill worker, before it prefills anything
    def prefilled() -> float:
        text = httpx.get(f"http://127.0.0.1:{disaggregated + 1}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("flowprefill_prompt_tokens_total"))
    before = prefilled()
    for body, param in (({"echo": True, "max_tokens": 0}, "echo"), ({"echo": True, "logprobs": 1}, "echo"),
                        ({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")):
        r = httpx.post(f"http://127.0.0.1:{disaggregated}/v1/completions",
                       json={"prompt": "hi", "max_tokens": 2} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert prefilled() == before


@pytest.mark.slow
def test_gateway_keeps_a_worker_out_of_a_pool_its_role_does_not_fit(disaggregated: int) -> None:
    """A decode worker listed as an ordinary (colocated) worker would refuse everything: the gateway
    reads its role and does not route there."""
    port = free_port()
    proc = start("gateway", "--workers", f"http://127.0.0.1:{disaggregated + 2}", "--port", str(port))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, ready=answers)  # up, with no worker it can use
        health = httpx.get(f"http://127.0.0.1:{port}/health")
        assert health.json()["workers"] == {f"http://127.0.0.1:{disaggregated + 2}": False}
        assert health.status_code == 503
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["x-flowprefill-dropped-reason"] == "no_healthy_worker"
    finally:
        stop(proc)


@pytest.mark.slow
def test_decode_without_handoff_times_out_cleanly(disaggregated: int) -> None:
    r = httpx.post(f"http://127.0.0.1:{disaggregated + 2}/v1/completions", timeout=60,
                   headers={"x-flowprefill-kv-id": "nobody-sent-this", "x-flowprefill-handoff-timeout-s": "0.2"},
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 504 and "no KV was handed off" in r.json()["error"]["message"]


@pytest.mark.slow
def test_failed_handoff_is_an_explicit_error_and_frees_the_kv(disaggregated: int) -> None:
    prefill = f"http://127.0.0.1:{disaggregated + 1}"
    r = httpx.post(f"{prefill}/v1/completions", timeout=60,
                   headers={"x-flowprefill-kv-to": f"http://127.0.0.1:{free_port()}", "x-request-id": "lost"},
                   json={"prompt": "x" * 300, "max_tokens": 4})
    assert r.status_code == 502 and "handing the KV" in r.json()["error"]["message"]
    assert _shm_leftovers() == []  # the shared-memory file of the failed hand-off is gone too
    assert httpx.get(f"{prefill}/load").json()["kv_cache_usage"] == 0
    # a prefill half must not stream: it answers with one token, not a stream
    r = httpx.post(f"{prefill}/v1/completions", timeout=60, headers={"x-flowprefill-kv-to": "http://x"},
                   json={"prompt": "hi", "stream": True})
    assert r.status_code == 400


def _shm_leftovers() -> list[str]:
    shm = kv_transport.SHM_DIR
    return sorted(p.name for p in shm.glob("flowprefill-kv-*")) if shm.is_dir() else []


@pytest.mark.slow
@pytest.mark.skipif(not kv_transport.SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_same_host_handoff_goes_through_shared_memory(disaggregated: int) -> None:
    """A loopback decode worker gets the KV through /dev/shm; forced HTTP gives the same tokens; no
    file is left behind either way."""
    prefill, decode = f"http://127.0.0.1:{disaggregated + 1}", f"http://127.0.0.1:{disaggregated + 2}"
    before = _shm_leftovers()
    texts = {}
    for transport in ("auto", "http"):
        rid = f"shm-test-{transport}"
        body = {"prompt": "Shared memory or a socket? " * 30, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        headers = {"x-flowprefill-kv-to": decode, "x-request-id": rid}
        if transport == "http":
            headers["x-flowprefill-kv-transport"] = "http"
        r = httpx.post(f"{prefill}/v1/completions", timeout=60, headers=headers, json=body | {"max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.headers["x-flowprefill-kv-transport"] == ("shm" if transport == "auto" else "http")
        assert int(r.headers["x-flowprefill-kv-bytes"]) > 0
        r = httpx.post(f"{decode}/v1/completions", timeout=60, json=body,
                       headers={"x-flowprefill-kv-id": rid, "x-request-id": rid})
        assert r.status_code == 200, r.text
        texts[transport] = r.json()["choices"][0]["text"]
    assert texts["auto"] == texts["http"]
    assert _shm_leftovers() == before
    assert httpx.get(f"{decode}/load").json()["kv_cache_usage"] == 0


@pytest.mark.slow
def test_shared_memory_names_are_checked_and_a_missing_file_falls_back_to_http(
        disaggregated: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decode = f"http://127.0.0.1:{disaggregated + 2}"
    # only our own file names: never a path
    r = httpx.post(f"{decode}/v1/internal/kv/x", headers={KV_SHM_HEADER: "../../etc/passwd"})
    assert r.status_code == 400 and "flowprefill-kv-" in r.json()["error"]["message"]
    r = httpx.post(f"{decode}/v1/internal/kv/x", headers={KV_SHM_HEADER: f"flowprefill-kv-{'0' * 32}.safetensors"})
    assert r.status_code == 404 and r.json()["error"]["code"] == kv_transport.SHM_MISSING
    # a sender whose shared-memory folder the decode worker cannot see (another container): HTTP after all
    monkeypatch.setattr(kv_transport, "SHM_DIR", tmp_path)
    kv = {f"{kind}.{layer}": torch.zeros(5, 2, 32) for layer in range(4) for kind in "kv"}

    async def go() -> tuple[str, int]:
        async with httpx.AsyncClient() as client:
            return await kv_transport.send(client, decode, "fallback", kv, Sampled(7))

    assert asyncio.run(go())[0] == "http"
    assert list(tmp_path.iterdir()) == []
    r = httpx.post(f"{decode}/v1/completions", timeout=60, headers={"x-flowprefill-kv-id": "fallback"},
                   json={"prompt": "x" * 5, "max_tokens": 2})
    assert r.status_code == 200, r.text
