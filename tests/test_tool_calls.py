"""Tool calls (engine/serving/tool_calls.py): the parsers, the request fields, tool-call responses whole and
streamed, and a worker with --tool-call-parser offering tools to the embedded model's template."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from helpers import EngineFactory

from engine.core.request import Request, TokenOutput
from engine.protocol.openai import ChatCompletionRequest, ChatMessage, StreamOptions, Unsupported
from engine.serving.choices import Choices, sse
from engine.serving.tool_calls import ToolCallParser
from engine.serving.worker import create_worker_app

HERMES, LLAMA = ToolCallParser("hermes"), ToolCallParser("llama3_json")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def calls(parsed: tuple[str | None, list[dict[str, Any]]]) -> tuple[str | None, list[tuple[str, Any]]]:
    content, made = parsed
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in made)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in made]


def test_hermes() -> None:
    one = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert calls(HERMES.parse(one)) == ("Let me check.", [("get_weather", {"city": "Oslo"})])
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>')
    assert calls(HERMES.parse(two)) == (None, [("a", {}), ("b", {"x": [1, 2]})])
    unterminated = '<tool_call>\n{"name": "a", "arguments": {"k": "v"}}'  # stopped at EOS before the tag
    assert calls(HERMES.parse(unterminated)) == (None, [("a", {"k": "v"})])
    assert HERMES.parse("no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "a", "arguments": {</tool_call>'  # not JSON: it stays text
    assert HERMES.parse(broken) == (broken, [])
    assert HERMES.start("abc<tool_call>") == 3 and HERMES.undecided("abc<tool") == 5 and HERMES.undecided("abc") == 0


def test_llama3_json() -> None:
    assert calls(LLAMA.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')) == (
        None, [("get_weather", {"city": "Oslo"})])
    several = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 1}}'
    assert calls(LLAMA.parse(several)) == (None, [("a", {}), ("b", {"y": 1})])
    assert LLAMA.parse("The weather is fine.") == ("The weather is fine.", [])
    assert LLAMA.parse('{"not": "a call"}') == ('{"not": "a call"}', [])
    assert LLAMA.start('  {"name"') == 2 and LLAMA.start("Sure: {") == -1
    assert LLAMA.undecided("  ") == 2 and LLAMA.undecided("<|py") == 4 and LLAMA.undecided("Sure") == 0


def test_request_fields() -> None:
    with_tools = ChatCompletionRequest(messages=[], tools=[WEATHER])
    assert with_tools.unsupported(tool_calls=False) == "tools"  # no parser on this server
    assert with_tools.unsupported(tool_calls=True) is None
    # a forced call needs no parser: structured output makes the answer the call (test_structured_output.py)
    required = ChatCompletionRequest(messages=[], tools=[WEATHER], tool_choice="required")
    assert required.unsupported(False) is None and required.forces_tool_call()
    assert not ChatCompletionRequest(messages=[], tools=[WEATHER], tool_choice="none").tools_wanted()
    with pytest.raises(Unsupported):
        ChatCompletionRequest(messages=[], tools=[WEATHER]).sampling(16)
    # a call in the history reaches the template with its arguments as an object (it writes the JSON)
    said = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    assert said.for_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


class _Engine:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


PIECES = ["Let me ", "check.", "\n<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
          "\n</tool_call>"]


def choices_fed(pieces: list[str], parser: ToolCallParser = HERMES) -> Choices:
    req = Request(request_id="r", prompt_token_ids=[1, 2, 3])
    queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
    for n, piece in enumerate(pieces):
        queue.put_nowait(TokenOutput("r", [65], piece, "stop" if n == len(pieces) - 1 else None))
        req.output_token_ids.append(65)
    return Choices(_Engine(), [req], queue, None, parser)  # type: ignore[arg-type]


def test_a_tool_call_answer_whole_and_streamed() -> None:
    whole = choices_fed(PIECES)
    asyncio.run(whole.gather())
    ((content, finish, _, made, _),) = whole.bodies()
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in made] == [
        ("get_weather", {"city": "Oslo"})]

    async def stream() -> list[dict[str, Any]]:
        chunks = [c async for c in sse(choices_fed(PIECES), "chatcmpl-1", "m", True, StreamOptions())]
        assert chunks[-1] == b"data: [DONE]\n\n"
        return [msgspec.json.decode(c[6:]) for c in chunks[:-1]]

    events = asyncio.run(stream())
    assert len(events) == len(PIECES)  # one event per token, held text or not
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."  # never a piece of the tag
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_plain_answer_with_tools_offered_streams_as_content() -> None:
    async def stream() -> list[dict[str, Any]]:
        chunks = [c async for c in sse(choices_fed(["The ", "weather <", "is fine."]), "c", "m", True, StreamOptions())]
        return [msgspec.json.decode(c[6:]) for c in chunks[:-1]]

    events = asyncio.run(stream())
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "The weather <is fine."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=16384, kv_block_size=64)
    yield factory
    factory.close()


def post(app: Any, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post("/v1/chat/completions", json=body)
    return asyncio.run(asyncio.wait_for(go(), 60))


def test_a_worker_offers_tools_to_the_template(make_engine: EngineFactory) -> None:
    eng = make_engine()
    base = {"messages": [{"role": "user", "content": "weather in Oslo?"}], "max_tokens": 4, "ignore_eos": True,
            "temperature": 0}
    plain = create_worker_app(eng, "m")
    refused = post(plain, base | {"tools": [WEATHER]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    served = create_worker_app(eng, "m", tool_call_parser="hermes")
    without, offered = post(served, base), post(served, base | {"tools": [WEATHER]})
    assert without.status_code == offered.status_code == 200
    # the tool's schema is in the prompt (the embedded model's template describes it in a system message)
    extra = len(json.dumps(WEATHER)) + 300
    assert without.json()["usage"]["prompt_tokens"] + extra < offered.json()["usage"]["prompt_tokens"]
    message = offered.json()["choices"][0]["message"]
    assert "tool_calls" not in message and offered.json()["choices"][0]["finish_reason"] == "length"
    none = post(served, base | {"tools": [WEATHER], "tool_choice": "none"})  # offered nothing
    assert none.json()["usage"]["prompt_tokens"] == without.json()["usage"]["prompt_tokens"]


# -- found by review --------------------------------------------------------------------------


def stream_of(pieces: list[str], parser: ToolCallParser = HERMES) -> list[dict[str, Any]]:
    async def go() -> list[bytes]:
        return [c async for c in sse(choices_fed(pieces, parser), "c", "m", True, StreamOptions())]
    return [msgspec.json.decode(c[6:]) for c in asyncio.run(go())[:-1]]


def test_content_and_calls_in_one_last_chunk_keep_the_content() -> None:
    events = stream_of(['Checking.<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    assert events[-1]["choices"][0]["delta"]["content"] == "Checking."
    assert events[-1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"


def test_whitespace_before_a_call_is_not_streamed_as_content() -> None:
    events = stream_of(["\n", '{"name": "f", ', '"parameters": {}}'], LLAMA)
    assert not any(e["choices"][0]["delta"].get("content") for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_json_answer_is_not_a_llama3_call_and_json_text_arguments_stay_as_given() -> None:
    assert LLAMA.parse('{"name": "Bob", "age": 3}') == ('{"name": "Bob", "age": 3}', [])
    _, made = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert json.loads(made[0]["function"]["arguments"]) == {"x": 1}


def test_the_default_template_writes_calls_and_results_as_qwen25s_does() -> None:
    from engine.core.tokenizer import ByteTokenizer

    history = [{"role": "user", "content": "U"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
               {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    out = ByteTokenizer().apply_chat_template(history, [WEATHER])
    assert out.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
                        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ByteTokenizer().apply_chat_template(plain) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("odd", [[{"id": "x"}], ["str"], [None], [{"function": "f"}],
                                 [{"function": {"name": "f", "arguments": "{not json"}}]])
def test_odd_tool_calls_in_the_history_are_a_400(make_engine: EngineFactory, odd: list) -> None:
    app = create_worker_app(make_engine(), "m")
    r = post(app, {"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": None, "tool_calls": odd},
                                {"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
