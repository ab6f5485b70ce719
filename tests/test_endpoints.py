"""The endpoints clients call beyond completions and chat, through a real gateway to a real worker
with the official openai client: `models.retrieve`, `responses.create` and `responses.stream`, vLLM's
/tokenize and /detokenize; and the SLO headers of llm-d's router (and their older names) reaching
the engine as a class, a TTFT and a TBT target."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from helpers import module_engine
from processes import free_port, start, stop, uvicorn_thread, wait_healthy
from pydantic import BaseModel

from engine.core.observer import EngineObserver
from engine.core.request import Request
from engine.serving.worker import create_worker_app

MODEL = "org/tiny"  # a slash, as Hugging Face ids have: the client sends it percent-encoded in the path
NO_WHITESPACE = {str(b): -100 for b in b" \t\n\r"}  # random weights would pad JSON with it


class Finished(EngineObserver):
    """The engine's requests as they finish, by id: what the worker made of their headers."""

    def __init__(self) -> None:
        self.reqs: dict[str, Request] = {}

    def on_finish(self, req: Request) -> None:
        self.reqs[req.request_id] = req


@pytest.fixture(scope="module")
def stack(torch_single_thread: None) -> Iterator[tuple[str, str, Finished]]:
    """(gateway URL, worker URL, the engine's finished requests): a worker app on the embedded model
    (uvicorn in this process) behind a `flowprefill gateway` process."""
    finished = Finished()
    with module_engine(kv_capacity_tokens=16384, kv_block_size=64) as engine:
        engine.observers.append(finished)
        with uvicorn_thread(create_worker_app(engine, MODEL), lifespan="off") as port:
            worker, gw_port = f"http://127.0.0.1:{port}", free_port()
            gateway = start("gateway", "--workers", worker, "--port", str(gw_port))
            try:
                wait_healthy(f"http://127.0.0.1:{gw_port}", gateway)
                yield f"http://127.0.0.1:{gw_port}", worker, finished
            finally:
                stop(gateway)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_retrieve(stack: tuple[str, str, Finished]) -> None:
    gateway, worker, _ = stack
    for url in (gateway, worker):
        raw = client(url).models.with_raw_response.retrieve(MODEL)
        model = raw.parse()
        assert (model.id, model.object, model.max_model_len) == (MODEL, "model", 32768), url  # type: ignore[attr-defined]
        with pytest.raises(openai.NotFoundError) as missing:
            client(url).models.retrieve("org/other")
        assert missing.value.code == "model_not_found" and missing.value.param == "model", url
        if url == gateway:  # classed and given an id, as every answer of the gateway's
            assert raw.headers["x-slo-class"] == "standard" and raw.headers["x-request-id"]


class Verdict(BaseModel):
    ok: bool
    mood: Literal["calm", "busy"]


def test_responses_create_and_stream(stack: tuple[str, str, Finished]) -> None:
    gateway, _, finished = stack
    c = client(gateway)
    raw = c.responses.with_raw_response.create(model=MODEL, instructions="be brief", input="hello",
                                               max_output_tokens=5, extra_headers={"x-slo-class": "interactive"},
                                               extra_body={"ignore_eos": True})  # sampled: EOS came first once
    got = raw.parse()
    assert raw.headers["x-slo-class"] == "interactive" and got.id == raw.headers["x-request-id"]
    assert got.id.startswith("resp_") and got.status == "incomplete" and got.usage.output_tokens == 5
    assert finished.reqs[got.id].slo_class == "interactive"  # classed and deadlined as chat is
    assert finished.reqs[got.id].ttft_target_s <= 0.25
    with c.responses.stream(model=MODEL, input=[{"role": "user", "content": "How are you?"}], text_format=Verdict,
                            max_output_tokens=40, temperature=0, extra_body={"logit_bias": NO_WHITESPACE}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert isinstance(final.output_parsed, Verdict) and final.usage is not None

    async def streamed() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
        events = await aclient.responses.create(model=MODEL, input="hi", max_output_tokens=3, stream=True,
                                                extra_body={"ignore_eos": True})  # sampled: EOS may come first
        kinds = [event.type async for event in events]
        await aclient.close()
        return kinds

    assert asyncio.run(streamed())[-1] == "response.incomplete"  # max_output_tokens cut it short, as OpenAI's
    refused = httpx.post(f"{gateway}/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"


def test_tokenize_through_the_gateway(stack: tuple[str, str, Finished]) -> None:
    gateway, _, _ = stack
    messages = [{"role": "user", "content": "hello there"}]
    got = httpx.post(f"{gateway}/tokenize", json={"messages": messages}, headers={"x-request-id": "tok-1"})
    assert got.status_code == 200 and got.headers["x-request-id"] == "tok-1" and got.headers["x-slo-class"]
    chat = httpx.post(f"{gateway}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert got.json()["count"] == chat["usage"]["prompt_tokens"]  # what chat prefills
    back = httpx.post(f"{gateway}/detokenize", json={"tokens": got.json()["tokens"]}).json()["prompt"]
    assert back.endswith("hello there<|im_end|>\n<|im_start|>assistant\n")
    assert httpx.post(f"{gateway}/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
    metrics = httpx.get(f"{gateway}/metrics").text
    assert 'flowprefill_gateway_requests_total{code="404",slo_class="standard"}' in metrics


@pytest.mark.parametrize(("headers", "cls", "ttft_at_most_s", "tbt_s"), [
    ({"x-llm-d-inference-objective": "batch"}, "batch", 6.0, 0.2),
    ({"x-gateway-inference-objective": "relaxed"}, "relaxed", 4.0, 0.2),
    ({"x-llm-d-inference-objective": "relaxed", "x-gateway-inference-objective": "batch"}, "relaxed", 4.0, 0.2),
    ({"x-slo-class": "interactive", "x-llm-d-inference-objective": "batch"}, "interactive", 0.25, 0.1),
    ({"x-llm-d-slo-ttft-ms": "300", "x-slo-ttft-ms": "5000"}, "standard", 0.3, 0.1),
    ({"x-slo-ttft-ms": "5000"}, "batch", 5.0, 0.2),
    ({"x-slo-class": "relaxed", "x-slo-ttft-ms": "48000"}, "relaxed", 48.0, 0.2),  # a class at a target of its own
    ({"x-llm-d-slo-tpot-ms": "40", "x-slo-tpot-ms": "90"}, "standard", 0.5, 0.04),
    ({"x-slo-tpot-ms": "90", "x-llm-d-inference-objective": "batch"}, "batch", 6.0, 0.09),
])
def test_llm_d_headers_reach_the_engine(stack: tuple[str, str, Finished], headers: dict[str, str], cls: str,
                                        ttft_at_most_s: float, tbt_s: float) -> None:
    """Through the gateway and straight to the worker (as llm-d's router sends them to a model
    server): the class, the TTFT target (less the time spent in the gateway) and the TBT target."""
    gateway, worker, finished = stack
    for url in (gateway, worker):
        rid = f"llmd-{abs(hash((url, *sorted(headers.items()))))}"
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers | {"x-request-id": rid},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and r.headers["x-slo-class"] == cls, (url, r.text)
        req = finished.reqs[rid]
        assert req.slo_class == cls and req.tbt_target_s == pytest.approx(tbt_s), url
        assert ttft_at_most_s * 0.9 < req.ttft_target_s <= ttft_at_most_s, url


@pytest.mark.parametrize("header", ["x-llm-d-inference-objective", "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms",
                                    "x-slo-tpot-ms"])
def test_bad_llm_d_headers_are_400s(stack: tuple[str, str, Finished], header: str) -> None:
    for url in stack[:2]:
        r = httpx.post(f"{url}/v1/responses", headers={header: "gold"}, json={"input": "hi", "max_output_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == header, (url, r.text)


def test_the_openapi_document_lists_them(stack: tuple[str, str, Finished]) -> None:
    doc: dict[str, Any] = httpx.get(f"{stack[0]}/openapi.json").json()
    assert {"/v1/responses", "/v1/models/{model_id}", "/tokenize", "/detokenize"} <= set(doc["paths"])
    names = {p["name"] for p in doc["paths"]["/v1/responses"]["post"]["parameters"]}
    assert {"x-llm-d-inference-objective", "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"} <= names
