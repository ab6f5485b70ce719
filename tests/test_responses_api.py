"""OpenAI's Responses API on the worker (the client's own types check every body and event; the
official client through the gateway is in test_endpoints.py): its input read as chat messages, the
same prompt and answer as chat's, reasoning and function-call output items, logprobs, structured
output, the fields it refuses by name, and a stream cut short leaving nothing behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import module_engine
from openai.types.responses import Response, ResponseStreamEvent
from processes import uvicorn_thread
from pydantic import TypeAdapter

from engine.core.engine import Engine
from engine.protocol.responses import ResponsesRequest
from engine.serving.worker import create_worker_app

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(torch_single_thread: None) -> Iterator[Engine]:
    with module_engine(kv_capacity_tokens=16384, kv_block_size=64) as eng:
        yield eng


def post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post(path, json=body)
    return asyncio.run(asyncio.wait_for(go(), 60))


def events(app: Any, body: dict[str, Any]) -> list[Any]:
    """A streamed response's events, each validated as the client's own type (strictly: a missing
    or mistyped field fails), in order."""
    r = post(app, "/v1/responses", body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    out = []
    for block in r.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {obj['type']}"
        out.append(EVENTS.validate_python(obj))
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def whole(app: Any, body: dict[str, Any]) -> Response:
    r = post(app, "/v1/responses", body)
    assert r.status_code == 200, r.text
    return Response.model_validate(r.json())


def test_input_items_become_chat_messages() -> None:
    request = ResponsesRequest(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is"},
                                     {"type": "input_text", "text": "2+2?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me call"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"b": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "4"}]},
        {"role": "developer", "content": "answer now"}],
        tools=[{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "add"}, max_output_tokens=7, reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}},
        include=["message.output_text.logprobs"], top_logprobs=3, top_k=5)
    chat = request.as_chat()
    got = [(m.role, m.content, [c["id"] for c in m.tool_calls or []], m.tool_call_id, m.reasoning_content)
           for m in chat.messages]
    assert got == [("system", "be brief", [], None, None), ("user", "what is\n2+2?", [], None, None),
                   ("assistant", "let me call", ["c1", "c2"], None, "add"), ("tool", "4", [], "c1", None),
                   ("tool", "4", [], "c2", None), ("developer", "answer now", [], None, None)]
    assert chat.tools == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"},
                                                            "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    assert (chat.max_tokens, chat.logprobs, chat.top_logprobs, chat.top_k) == (7, True, 3, 5)
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}  # as vLLM's: templates may read it
    assert ResponsesRequest(input="hi").as_chat().messages[0].content == "hi"


def test_the_prompt_and_answer_are_chats(engine: Engine) -> None:
    """The same conversation as a chat completion and as a response: the same prompt tokens, the same
    greedy answer; cut short by max_output_tokens it is incomplete."""
    app = create_worker_app(engine, "m")
    chat = post(app, "/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hello"}],
                                              "max_tokens": 6, **GREEDY}).json()
    got = whole(app, {"instructions": "be brief", "input": "hello", "max_output_tokens": 6, **GREEDY})
    assert got.id.startswith("resp_") and got.status == "incomplete" and got.model == "m"
    assert got.incomplete_details is not None and got.incomplete_details.reason == "max_output_tokens"
    assert got.output_text == chat["choices"][0]["message"]["content"]
    assert got.usage is not None and got.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert (got.usage.output_tokens, got.usage.total_tokens) == (6, chat["usage"]["total_tokens"])
    assert [item.type for item in got.output] == ["message"] and got.output[0].status == "incomplete"
    streamed = events(app, {"instructions": "be brief", "input": "hello", "max_output_tokens": 6, **GREEDY})
    assert [e.type for e in streamed[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                             "response.content_part.added"]
    assert [e.type for e in streamed[-4:]] == ["response.output_text.done", "response.content_part.done",
                                              "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    (done,) = [e for e in streamed if e.type == "response.output_text.done"]
    final = streamed[-1]
    assert final.type == "response.incomplete" and deltas == done.text == got.output_text
    assert final.response.output_text == got.output_text and final.response.usage.output_tokens == 6
    assert len({e.response.id for e in streamed if hasattr(e, "response")}) == 1


def test_logprobs_and_structured_output(engine: Engine) -> None:
    """Logprobs as output_text's; streamed, each with its token's text delta (a token whose text is held
    back, or has none, with the next; the rest with the text's done event)."""
    app = create_worker_app(engine, "m")
    printable = {str(t): -100 for t in range(engine.model.cfg.vocab_size) if not 32 <= t < 127}
    for bias in ({}, {"logit_bias": printable}):
        body = {"input": "hi", "max_output_tokens": 4, "include": ["message.output_text.logprobs"],
                "top_logprobs": 2, **GREEDY, **bias}
        entries = whole(app, body).output[0].content[0].logprobs
        assert entries is not None and len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
        if not bias:  # greedy: the likeliest (a bias moves the choice, not the reported distribution)
            assert entries[0].top_logprobs[0].logprob == pytest.approx(entries[0].logprob)
        streamed = events(app, body)
        sent = [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
        (done,) = [e for e in streamed if e.type == "response.output_text.done"]
        assert [lp.token for lp in done.logprobs] == [e.token for e in entries]
        assert sent == ([e.token for e in entries] if bias else [])  # printable: each with its delta
    schema = {"type": "object", "properties": {"up": {"type": "boolean"}}, "required": ["up"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "status", "schema": schema, "strict": True}
    shaped = whole(app, {"input": "status?", "max_output_tokens": 30, "temperature": 0, "text": {"format": fmt},
                         "structured_outputs": {"disable_any_whitespace": True}})
    assert shaped.status == "completed" and isinstance(json.loads(shaped.output_text)["up"], bool)


def test_reasoning_comes_as_a_reasoning_item(engine: Engine) -> None:
    """The embedded model's random weights never close a reasoning: under deepseek_r1 the answer is all
    reasoning (no message), counted as reasoning tokens; under qwen3 it is all message."""
    printable = {str(t): -100 for t in range(engine.model.cfg.vocab_size) if not 32 <= t < 127}
    body = {"input": "hi", "max_output_tokens": 8, "logit_bias": printable, **GREEDY}
    r1 = create_worker_app(engine, "m", reasoning_parser="deepseek_r1")
    chat = post(r1, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                             "logit_bias": printable, **GREEDY}).json()["choices"][0]["message"]
    got = whole(r1, body)
    assert [item.type for item in got.output] == ["reasoning"]
    assert got.output[0].content[0].text == chat["reasoning_content"] and got.output_text == ""
    assert got.usage.output_tokens_details.reasoning_tokens == got.usage.output_tokens == 8
    streamed = events(r1, body)
    assert "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta") == chat["reasoning_content"]
    assert streamed[-1].response.output[0].type == "reasoning"
    qwen3 = whole(create_worker_app(engine, "m", reasoning_parser="qwen3"), body)
    assert [item.type for item in qwen3.output] == ["message"]
    assert qwen3.usage.output_tokens_details.reasoning_tokens == 0


TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                         "required": ["city"], "additionalProperties": False}}]
NO_WHITESPACE = {str(b): -100 for b in b" \t\n\r"}  # random weights would pad the JSON until the limit


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_function_calls_are_output_items(engine: Engine, choice: Any) -> None:
    """A forced call (no tool-call parser needed): a function_call item, its arguments the schema's,
    whole and streamed."""
    app = create_worker_app(engine, "m")
    body = {"input": "weather in Oslo?", "tools": TOOLS, "tool_choice": choice, "max_output_tokens": 200,
            "temperature": 0, "logit_bias": NO_WHITESPACE, "parallel_tool_calls": False}
    got = whole(app, body)
    calls = [item for item in got.output if item.type == "function_call"]
    assert got.status == "completed" and calls and calls[0].name == "get_weather", got
    assert calls[0].call_id.startswith("call_") and json.loads(calls[0].arguments)["city"] in ("Oslo", "Lima")
    streamed = events(app, body)
    final = [item for item in streamed[-1].response.output if item.type == "function_call"]
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"][:1] or [None]
    assert final and done is not None and args == done.arguments == final[0].arguments == calls[0].arguments
    assert streamed[-1].type == "response.completed"


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
])
def test_what_is_not_done_is_refused_by_name(engine: Engine, extra: dict[str, Any], param: str) -> None:
    r = post(create_worker_app(engine, "m"), "/v1/responses", {"input": "hi", "max_output_tokens": 2} | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "unsupported_parameter", r.text


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "needs a schema"),
    ({"input": [{"type": "function_call_output", "output": "4"}]}, 400, "needs a call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "unknown message role"),
    ({"input": []}, 400, "must not be empty"),
    ({"input": 5}, 400, "invalid request body"),
    ({"input": "hi", "model": "gpt-9"}, 404, "does not exist"),
])
def test_bad_requests_are_openai_errors(engine: Engine, body: dict[str, Any], status: int, words: str) -> None:
    r = post(create_worker_app(engine, "m"), "/v1/responses", body)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_a_stream_the_client_leaves_is_cancelled(engine: Engine) -> None:
    """A real server (ASGITransport would buffer the stream): the client leaves after the first text
    and the engine lets the request go."""
    rid, printable = "", {str(t): -100 for t in range(engine.model.cfg.vocab_size) if not 32 <= t < 127}
    with uvicorn_thread(create_worker_app(engine, "m"), lifespan="off") as port, httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/responses", timeout=60,
            json={"input": "hi", "max_output_tokens": 4000, "stream": True, "logit_bias": printable, **GREEDY}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                rid = rid or event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    assert engine.has_request(rid)
                    break
        else:
            raise AssertionError("no text came")
        deadline = time.monotonic() + 10
        r.close()
        while engine.has_request(rid):
            assert time.monotonic() < deadline, "the engine still holds the request"
            time.sleep(0.05)
    assert not engine.num_decoding and not engine.num_waiting
