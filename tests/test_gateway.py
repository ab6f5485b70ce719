"""The gateway in front of real engine workers, through the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from processes import free_port, serving, start, stop, wait_healthy


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`flowprefill serve`: the gateway and one worker child process."""
    with serving() as url:
        yield url
    # No orphans: the worker child is gone with the gateway.
    port = int(url.rsplit(":", 1)[1])
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=1)


def test_openai_client_sync_and_stream(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    out = client.completions.create(model="flowprefill-default", prompt="Hello", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 5
    raw = client.completions.with_raw_response.create(model="flowprefill-default", prompt="Hi", max_tokens=2,
                                                      extra_headers={"x-slo-class": "interactive"})
    assert raw.headers["x-slo-class"] == "interactive" and raw.headers["x-request-id"]
    chunks = list(client.chat.completions.create(
        model="flowprefill-default", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    (model,) = client.models.list().data
    assert model.id == "flowprefill-default" and model.max_model_len == 32768  # vLLM's field: the context


def test_openai_async_client(served: str) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused")
        out = await client.chat.completions.create(model="flowprefill-default", max_tokens=3,
                                                   messages=[{"role": "user", "content": "hello"}])
        assert out.choices[0].message.role == "assistant"
        stream = await client.completions.create(model="flowprefill-default", prompt=[65, 66, 67], max_tokens=3,
                                                 stream=True, extra_body={"ignore_eos": True})  # EOS: 'stop' ~1 %
        reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
        assert reasons[-1] == "length"
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize(("body", "headers", "status"), [
    (b"{not json", {}, 400),
    (b'{"prompt": "x", "max_tokens": 0}', {}, 400),
    (b'{"prompt": "x", "max_tokens": 2}', {"x-slo-class": "platinum"}, 400),
    (b'{"prompt": "x", "max_tokens": 2}', {"x-slo-ttft-ms": "soon"}, 400),
    (b'{"prompt": "x", "max_tokens": 2, "model": "gpt-9"}', {}, 404),
    (b'{"prompt": 5}', {}, 400),
    (b'{"prompt": [1.99e82]}', {}, 400),  # a one-element list of neither (schemathesis found a 500)
    (b'{"prompt": [[true, false]]}', {}, 400),  # booleans are not token ids
    (b'[1, 2]', {}, 400),
    (b'{"prompt": "x", "temperature": "hot"}', {}, 400),
    (b'{"prompt": [65, 66], "max_tokens": 40000}', {}, 400),  # beyond the model's context
    (b'{"prompt": "x"}', {"x-slo-class": "a" * 300}, 400),
    (b'{"prompt": "x", "presence_penalty": 3}', {}, 400),
    (b'{"prompt": [9223372036854775808], "max_tokens": 1}', {"x-slo-class": "batch"}, 400),  # past int64, sheddable
    (b'{"prompt": "x", "logit_bias": {"99999": 5}}', {}, 400),  # not a token of this model
    (b'{"prompt": "x", "logit_bias": {"x": 5}}', {}, 400),
    (b'{"prompt": "x", "logprobs": 21}', {}, 400),
    (b'{"prompt": "x", "suffix": "y"}', {}, 400),  # refused, not ignored: see test_unsupported_fields...
    (b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}', {}, 413),  # past the body limit
])
def test_bad_input_gets_openai_errors(served: str, body: bytes, headers: dict[str, str], status: int) -> None:
    r = httpx.post(f"{served}/v1/completions", content=body, headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert len(err["message"]) < 300  # a bad header is not echoed back whole


def test_logprobs_in_openais_shapes(served: str) -> None:
    """Through the gateway, parsed by the OpenAI client: chat's and completions' logprobs, whole and
    streamed, one entry per generated token, each token's own logprob among its top alternatives."""
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="flowprefill-default", messages=msgs, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the likeliest
    # the tokens' bytes make up the text, whatever characters straddle tokens
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == chat.choices[0].message.content
    comp = client.completions.create(model="flowprefill-default", prompt="Hello", max_tokens=4, temperature=0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model="flowprefill-default", messages=msgs, max_tokens=5, temperature=0, logprobs=True, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [e.token for chunk in streamed for e in chunk.content] == [e.token for e in content]
    plain = client.completions.create(model="flowprefill-default", prompt="Hello", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_a_repeated_prompt_reports_its_cached_tokens(served: str) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens, and the worker's prefix cache counters."""
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    prompt = "You are a careful assistant. Answer in one word. " * 12  # 600 bytes: two 256-token blocks
    first = client.completions.create(model="flowprefill-default", prompt=prompt + "Ready?", max_tokens=1)
    again = client.completions.create(model="flowprefill-default", prompt=prompt + "Steady?", max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 512
    worker = served.rsplit(":", 1)[0] + f":{int(served.rsplit(':', 1)[1]) + 1}"
    metrics = httpx.get(f"{worker}/metrics").text
    hits = [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("flowprefill_prefix_cache_hits_total")]
    assert hits and hits[0] >= 512


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "!"}, "suffix"),
])
def test_unsupported_fields_are_refused_by_name(served: str, path: str, body: dict, param: str) -> None:
    """A client asking for tool calls or JSON must not get plain text as though it had been done."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"}
    r = httpx.post(f"{served}/v1/{path}", json=base | body | {"max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "unsupported_parameter"


def test_structured_output_through_the_openai_clients_parse(served: str) -> None:
    """The client's own structured-output helper (a pydantic model as a strict JSON schema) through
    the gateway: the answer parses into the model. Compact JSON: left free to write whitespace, the
    embedded model's random weights would write nothing else."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        mood: Literal["calm", "busy"]

    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    got = client.chat.completions.parse(model="flowprefill-default", messages=[{"role": "user", "content": "hi"}],
                                        response_format=Verdict, max_tokens=40, temperature=0,
                                        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    parsed = got.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and got.choices[0].finish_reason == "stop"


def test_streams_are_server_sent_events_with_one_content_type(served: str) -> None:
    worker = served.rsplit(":", 1)[0] + f":{int(served.rsplit(':', 1)[1]) + 1}"
    for url in (served, worker):  # Litestar once sent the handler's JSON type; the gateway copied it twice
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
            types = [v for k, v in r.headers.multi_items() if k == "content-type"]
            assert types == ["text/event-stream; charset=utf-8"] or types == ["text/event-stream"], (url, types)
            r.read()
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert [v for k, v in r.headers.multi_items() if k == "content-type"] == ["application/json"]


def test_chat_messages_as_clients_send_them(served: str) -> None:
    def chat(messages: list, **extra: object) -> httpx.Response:
        return httpx.post(f"{served}/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra})

    plain = chat([{"role": "user", "content": "hello\nthere"}])
    parts = chat([{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}])
    assert plain.status_code == parts.status_code == 200
    assert parts.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]  # joined, not repr'd
    assert plain.json()["id"].startswith("chatcmpl-")
    history = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ann"},
               {"role": "assistant", "content": None, "tool_calls": []}, {"role": "user", "content": "and?"}]
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "top_k": None, "ignore_eos": None,
             "stop": None, "seed": None, "presence_penalty": None, "logprobs": None, "user": None}
    assert chat(history, **nulls).status_code == 200
    for bad, words in (([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                        "only text content parts"),
                       ([{"role": "bogus", "content": "hi"}], "unknown message role"), ([], "must not be empty")):
        r = chat(bad)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_reused_request_id_does_not_collide(served: str) -> None:
    headers = {"x-request-id": "same-id"}
    body = {"prompt": "x" * 200, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served}/v1/completions", json=body, headers=headers) as first:
        lines = first.iter_lines()
        next(lines)  # under way
        second = httpx.post(f"{served}/v1/completions", json={"prompt": "y", "max_tokens": 1}, headers=headers)
        assert second.status_code == 200, second.text
        assert second.headers["x-request-id"].startswith("same-id-")  # the worker's, unique
        assert second.headers["x-request-id"] == second.json()["id"]
        assert [line for line in lines if line][-1] == "data: [DONE]"


def test_stream_options(served: str) -> None:
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"  # without stream: refused
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{served}/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 3]  # vLLM's running usage, then the total
    assert events[-1]["choices"] == []


def test_chat_without_max_tokens_runs_to_its_end() -> None:
    from engine.serving.worker import CHAT_DEFAULT_MAX_TOKENS, chat_default_max_tokens

    assert chat_default_max_tokens(100, 32768) == CHAT_DEFAULT_MAX_TOKENS  # not OpenAI's completions 16
    assert chat_default_max_tokens(1500, 2048) == 548  # what the KV cache (or the context) leaves
    assert chat_default_max_tokens(5000, 2048) == 1  # no room: validation refuses it, naming the limit


def test_unknown_route_and_method_get_openai_errors(served: str) -> None:
    r = httpx.get(f"{served}/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{served}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_failover_when_a_worker_dies() -> None:
    ports = [free_port(), free_port()]
    workers = [start("worker", "--model", "tiny", "--port", str(p), "--threads", "1", "--kv-capacity-tokens", "32768")
               for p in ports]
    gw_port = free_port()
    gateway = start("gateway", "--port", str(gw_port), "--workers", ",".join(f"http://127.0.0.1:{p}" for p in ports))
    url = f"http://127.0.0.1:{gw_port}"
    try:
        for p, w in zip(ports, workers, strict=True):
            wait_healthy(f"http://127.0.0.1:{p}", w)
        wait_healthy(url, gateway)
        deadline = time.monotonic() + 30
        while not all(httpx.get(f"{url}/health").json()["workers"].values()):  # the gateway's view
            assert time.monotonic() < deadline
            time.sleep(0.2)
        workers[0].kill()
        workers[0].wait()
        for _ in range(6):  # every request lands, on the surviving worker
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hey", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        workers[1].kill()
        workers[1].wait()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hey", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.headers["x-flowprefill-dropped-reason"] == "no_healthy_worker"
    finally:
        for proc in [gateway, *workers]:
            if proc.poll() is None:
                stop(proc)


def test_client_going_away_cancels_the_engine_work(served: str) -> None:
    """A client that disconnects mid-stream ends the request in the engine: its KV comes back."""
    worker = served.rsplit(":", 1)[0] + f":{int(served.rsplit(':', 1)[1]) + 1}"
    body = {"prompt": "tell me everything", "max_tokens": 30000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        load = httpx.get(f"{worker}/load").json()
        assert load["decoding"] + load["waiting"] >= 1 and load["kv_cache_usage"] > 0
    deadline = time.monotonic() + 15
    while True:  # the stream is closed: the gateway closes its upstream, the worker cancels
        load = httpx.get(f"{worker}/load").json()
        if load["decoding"] == 0 and load["waiting"] == 0 and load["kv_cache_usage"] == 0:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.1)


def test_sheddable_request_predicted_to_miss_is_shed_with_retry_after(served: str) -> None:
    """A `relaxed` request (sheddable, 4 s) that cannot be prefilled in 4 s even if run next gets a
    429 with Retry-After and the reason; an `interactive` one (not sheddable) is served anyway."""
    long_prompt = [65 + i % 26 for i in range(30000)]
    # A miss that no batch of its size (past 8K tokens) has confirmed refuses only when it misses even 4x
    # faster (UNCONFIRMED_SPEEDUP), and 30K tokens predict about 6-13 s on a fast core: run one past 8K first.
    confirm = httpx.post(f"{served}/v1/completions", json={"prompt": long_prompt[:8300], "max_tokens": 1},
                         headers={"x-slo-class": "interactive"}, timeout=60)
    assert confirm.status_code == 200, confirm.text
    r = httpx.post(f"{served}/v1/completions", json={"prompt": long_prompt, "max_tokens": 1},
                   headers={"x-slo-class": "relaxed"}, timeout=60)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert r.headers["x-flowprefill-dropped-reason"] == "predicted_slo_miss"
    assert r.json()["error"]["code"] == "predicted_slo_miss"
    ok = httpx.post(f"{served}/v1/completions", json={"prompt": [66 + i % 20 for i in range(8300)], "max_tokens": 1},
                    headers={"x-slo-class": "interactive"}, timeout=60)  # ~1 s of prefill, none cached: a miss
    assert ok.status_code == 200 and ok.headers["x-flowprefill-predicted-miss"] == "true"
    metrics = httpx.get(f"{served}/metrics").text
    assert 'flowprefill_gateway_shed_total{reason="predicted_slo_miss",slo_class="relaxed"} 1.0' in metrics
    assert 'flowprefill_gateway_requests_total{code="429",slo_class="relaxed"} 1.0' in metrics
    assert 'flowprefill_gateway_requests_total{code="200",slo_class="interactive"}' in metrics


def test_n_choices(served: str) -> None:
    """n choices, as OpenAI's: indexes 0..n-1, the prompt counted once in usage, seeds that make them
    differ yet reproducible; streamed, each choice's chunks carry its index and end on their own."""
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")

    def sampled() -> list[str]:
        out = client.completions.create(model="flowprefill-default", prompt="Once upon a time", max_tokens=8, n=3,
                                        temperature=1.0, seed=5, extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert all(c.finish_reason == "length" for c in out.choices)
        assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len("Once upon a time")
        return [c.text for c in out.choices]

    first = sampled()
    assert len(set(first)) > 1 and sampled() == first
    greedy = client.chat.completions.create(model="flowprefill-default", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, n=2, temperature=0, logprobs=True,
                                            extra_body={"ignore_eos": True})
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert all(len(c.logprobs.content) == 4 for c in greedy.choices)
    chunks = list(client.chat.completions.create(
        model="flowprefill-default", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    by_index: dict[int, list] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        by_index[choice.index].append(choice)
    for choices in by_index.values():
        assert len(choices) == 3 and choices[0].delta.role == "assistant" and choices[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    for n in (0, 129):
        r = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_a_workers_answer_reports_its_load_to_the_gateway_only(served: str) -> None:
    """The worker's answer carries ORCA's load report with its predicted backlog as the headers leave: a
    streamed answer's once it is admitted, the request's own prefill in it; an answer sent whole, once
    done, without it (nothing else queued: none). The gateway reads it and does not pass it on."""
    from engine.protocol.worker import LOAD_REPORT_HEADER, reported_backlog_s

    worker = f"http://127.0.0.1:{int(served.rsplit(':', 1)[1]) + 1}"
    body = {"model": "flowprefill-default", "prompt": "Hello there " * 40, "max_tokens": 1}
    reported = {}
    for stream in (False, True):
        r = httpx.post(f"{worker}/v1/completions", json=body | {"stream": stream}, timeout=60)
        assert r.status_code == 200
        reported[stream] = reported_backlog_s(r.headers[LOAD_REPORT_HEADER])
    assert reported[True] is not None and reported[True] > 0 and reported[False] == 0.0, reported
    through = httpx.post(f"{served}/v1/completions", json=body, timeout=60)
    assert through.status_code == 200 and LOAD_REPORT_HEADER not in through.headers


def test_load_reports_are_read_only_where_they_are_ours() -> None:
    from engine.protocol.worker import WorkerLoad, load_report, reported_backlog_s

    assert reported_backlog_s(load_report(WorkerLoad(predicted_backlog_s=1.25))) == 1.25
    assert reported_backlog_s("TEXT cpu_utilization=0.3, named_metrics.predicted_backlog_s=0.5") == 0.5
    for other in ("TEXT named_metrics.kv_cache_usage=0.4", "JSON {\"named_metrics\": {}}", "",
                  "TEXT named_metrics.predicted_backlog_s=abc", "TEXT named_metrics.predicted_backlog_s=-1",
                  "TEXT named_metrics.predicted_backlog_s=inf"):
        assert reported_backlog_s(other) is None, other
