"""The gateway as an install of its own (the base install: no engine extra, no torch), in front of a
plain OpenAI server: here a small one in this process, as vLLM or SGLang would answer. `.ci/run` runs
this in a fresh venv with only the gateway's dependencies (and the test tools)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar import Litestar, Request, get, post
from litestar.response import Stream
from processes import free_port, in_process, mapped_heavy, start, stop, uvicorn_thread, wait_healthy
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.gateway_only

MODEL = "plain/model"


def plain_openai_server(seen: list[dict[str, Any]]) -> Litestar:
    """An OpenAI-compatible server that echoes the prompt's length; `seen` gets each request's body
    and headers."""

    async def record(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        seen.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        return body

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> dict[str, Any]:
        body = await record(request)
        return {"id": "cmpl-up", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": f"{len(body['prompt'])} chars", "logprobs": None,
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request) -> Any:
        body = await record(request)
        if not body.get("stream"):
            return {"id": "chatcmpl-up", "object": "chat.completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
                                 "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

        async def events() -> AsyncIterator[bytes]:
            for i, (text, finish) in enumerate((("hello", None), (" there", "stop"))):
                delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
                chunk = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return Stream(events(), media_type="text/event-stream")

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "up"}]}

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return Litestar([completions, chat, models, health])


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, int, list[dict[str, Any]]]]:
    """`flowprefill gateway --upstream openai` in front of the plain server: its URL, pid, and what
    the server saw."""
    seen: list[dict[str, Any]] = []
    with uvicorn_thread(plain_openai_server(seen)) as up_port:
        port = free_port()
        proc = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(port),
                     "--upstream", "openai", "--max-concurrency", "2")
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=60)
            yield f"http://127.0.0.1:{port}", proc.pid, seen
        finally:
            stop(proc)


def test_the_openai_client_through_the_gateway(gateway: tuple[str, int, list[dict[str, Any]]]) -> None:
    """Completions, chat, a streamed chat and the model list, as the server answered them; each request
    classed and stamped by the gateway: its SLO headers, and the class's priority in vLLM's field."""
    url, _, seen = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    done = client.completions.with_raw_response.create(model=MODEL, prompt="four", max_tokens=2,
                                                       extra_headers={"x-slo-class": "interactive"})
    assert done.headers["x-slo-class"] == "interactive" and done.parse().choices[0].text == "4 chars"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "hello there"
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                              extra_headers={"x-slo-class": "batch"})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "hello there"
    assert [m.id for m in client.models.list()] == [MODEL]
    by_path = [(s["path"], s["body"].get("priority"), s["headers"].get("x-slo-class")) for s in seen]
    assert by_path == [("/v1/completions", 0, "interactive"), ("/v1/chat/completions", 1, "standard"),
                       ("/v1/chat/completions", 3, "batch")]  # vLLM's priority: lower runs sooner
    assert all(s["headers"]["x-request-id"] and float(s["headers"]["x-slo-ttft-ms"]) > 0 for s in seen)
    answered = {(s.labels["slo_class"], s.labels["code"]): s.value
                for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                for s in family.samples if s.name == "flowprefill_gateway_requests_total"}
    assert answered == {("interactive", "200"): 1, ("standard", "200"): 2, ("batch", "200"): 1}


def test_a_class_named_in_any_case_is_answered_by_its_name(gateway: tuple[str, int, list[dict[str, Any]]]) -> None:
    """`x-slo-class: Interactive` (or `INTERACTIVE`) is `interactive`, as header names are in any case:
    accepted, sent on as `interactive` and echoed so (after the test above: it counts every request)."""
    url, _, seen = gateway
    for sent in ("Interactive", "INTERACTIVE"):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "four", "max_tokens": 2},
                       headers={"x-slo-class": sent, "x-request-id": f"case-{sent}"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-slo-class"] == "interactive", (sent, r.status_code, r.text)
        upstream = next(s for s in seen if s["headers"].get("x-request-id") == f"case-{sent}")
        assert upstream["headers"]["x-slo-class"] == "interactive" and upstream["body"]["priority"] == 0


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_the_running_gateway_maps_no_engine(gateway: tuple[str, int, list[dict[str, Any]]]) -> None:
    """Seen from the running process, whatever is installed beside it: no torch, numpy, tokenizers,
    locust or matplotlib native code loaded."""
    _, pid, _ = gateway
    heavy, libraries = mapped_heavy(pid)
    assert any("/msgspec/" in lib for lib in libraries)  # it does see the gateway's own
    assert not heavy, heavy


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="the engine extra is installed here")
@pytest.mark.parametrize("command", [["serve"], ["worker"], ["bench", "prefill"], ["loadtest"]])
def test_a_command_that_needs_an_extra_says_which(command: list[str]) -> None:
    """Without the engine extra, `serve` is one line naming what to install, not a traceback."""
    done = subprocess.run([sys.executable, "-m", "gateway.cli", *command], capture_output=True, text=True, timeout=60)
    extra = "loadtest" if command == ["loadtest"] else "engine"
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"needs the {extra} extra" in done.stderr and f"pip install 'flowprefill[{extra}]'" in done.stderr


def test_a_benchmarks_help_needs_no_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench epp --help` prints its usage where the epp extra is not installed (here, or made to look
    so); run, it still says which extra it needs, in one line."""
    import gateway.cli.common

    monkeypatch.setattr(gateway.cli.common, "missing_extra", lambda extra: ["grpcio"] if extra == "epp" else [])
    helped = in_process(capsys, "bench", "epp", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: flowprefill bench epp"), helped
    assert "--concurrency" in helped.stdout and not helped.stderr
    refused = in_process(capsys, "bench", "epp")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused
    assert "needs the epp extra" in refused.stderr and "pip install 'flowprefill[epp]'" in refused.stderr
