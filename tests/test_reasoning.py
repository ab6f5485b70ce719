"""Reasoning models (engine/serving/reasoning.py, --reasoning-parser): reasoning apart from content, whole
and streamed (any cut of the text streams to what the whole answer gives), with tool calls after
the reasoning, chat_template_kwargs, and a structured output that waits for the reasoning to close."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import torch
from helpers import module_engine

from engine.core.decode import OutputStream
from engine.core.engine import Engine
from engine.core.request import Request, Sampled, SamplingParams, TokenOutput
from engine.core.sampling import sample
from engine.core.tokenizer import ByteTokenizer, _ChatTemplate
from engine.protocol.openai import ChatCompletionRequest, StreamOptions
from engine.serving.choices import Choices, sse
from engine.serving.reasoning import CLOSE, ReasoningParser, ReasoningStream
from engine.serving.structured_output import Grammars, Guide, GuidedAnswer
from engine.serving.tool_calls import ToolCallParser
from engine.serving.worker import create_worker_app

R1, QWEN3 = ReasoningParser("deepseek_r1"), ReasoningParser("qwen3")


@pytest.mark.parametrize(("parser", "thinking", "text", "want"), [
    (R1, True, "<think>\nlet me see</think>\n\nIt is 4.", ("\nlet me see", "\n\nIt is 4.")),  # as vLLM's
    (R1, True, "no opening tag</think>It is 4.", ("no opening tag", "It is 4.")),
    (R1, True, "never closed", ("never closed", "")),  # all reasoning, as vLLM's
    (QWEN3, False, "<think>hmm</think>\n\nIt is 4.", ("hmm", "\n\nIt is 4.")),
    (QWEN3, False, "It is 4.", (None, "It is 4.")),  # no reasoning (enable_thinking false)
    (QWEN3, True, "opened by the prompt</think>x", ("opened by the prompt", "x")),
    (QWEN3, False, "<think>cut short", ("cut short", "")),
])
def test_split(parser: ReasoningParser, thinking: bool, text: str, want: tuple[str | None, str]) -> None:
    assert parser.split(text, thinking) == want


TEXTS = ["<think>\nlet me see</think>\n\nThe answer is 4.", "plain answer", "  <think>abc", "reasoning only</think>ok",
         "<th", "</think>", "<think></think>x", "a</thi", "\n\n<think>x</think>  \n y", "<think>a</think>b</think>c"]


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("thinking", [True, False])
def test_any_cut_of_a_stream_gives_the_whole_answers_split(parser: ReasoningParser, thinking: bool) -> None:
    thinking = thinking or parser.name == "deepseek_r1"
    for text in TEXTS:
        reasoning, content = parser.split(text, thinking)
        for seed in range(20):
            rng, stream, got, at = random.Random(seed), ReasoningStream(parser, thinking), ["", ""], 0
            while at < len(text):
                n = rng.randint(1, 4)
                r, c = stream.push(text[at:at + n])
                assert CLOSE not in r and CLOSE not in c and "<think>" not in r
                got[0], got[1], at = got[0] + r, got[1] + c, at + n
            r, c = stream.push("", final=True)
            assert (got[0] + r, got[1] + c) == (reasoning or "", content), (text, seed)
            assert stream.thinking == (reasoning is not None)


def test_where_reasoning_begins() -> None:
    assert QWEN3.starts_thinking("<|im_start|>assistant\n<think>\n") and not QWEN3.starts_thinking("assistant\n")
    assert R1.starts_thinking("anything")
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's template, enable_thinking false
    assert not R1.starts_thinking(closed) and not QWEN3.starts_thinking(closed)
    assert QWEN3.may_open("assistant\n") and not QWEN3.may_open(closed) and not QWEN3.may_open("<think>\n")
    assert not R1.may_open("assistant\n")


# -- responses ------------------------------------------------------------------------------------


class _Engine:
    def cancel(self, rid: str) -> None:
        pass


def fed(pieces: list[str], parser: ReasoningParser = R1, tools: ToolCallParser | None = None) -> Choices:
    req = Request(request_id="r", prompt_token_ids=[1, 2, 3])
    queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
    for n, piece in enumerate(pieces):
        queue.put_nowait(TokenOutput("r", [65], piece, "stop" if n == len(pieces) - 1 else None))
        req.output_token_ids.append(65)
    return Choices(_Engine(), [req], queue, None, tools, lambda: ReasoningStream(parser, True))  # type: ignore[arg-type]


PIECES = ["<thi", "nk>Two and", " two.</th", "ink>\n\n", "Four", "."]


def test_whole_and_streamed_responses() -> None:
    whole = fed(PIECES)
    asyncio.run(whole.gather())
    ((content, finish, _, calls, reasoning),) = whole.bodies()
    assert (content, finish, calls, reasoning) == ("\n\nFour.", "stop", [], "Two and two.")

    async def stream() -> list[dict[str, Any]]:
        return [msgspec.json.decode(c[6:]) for c in [c async for c in sse(fed(PIECES), "c", "m", True,
                                                                           StreamOptions())][:-1]]
    deltas = [e["choices"][0]["delta"] for e in asyncio.run(stream())]
    assert len(deltas) == len(PIECES)  # an event per token, as ever
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nFour."
    never_closed = fed(["still", " thinking"])
    asyncio.run(never_closed.gather())
    assert never_closed.bodies()[0][0] is None and never_closed.bodies()[0][4] == "still thinking"


def test_tool_calls_are_read_from_the_content_after_the_reasoning() -> None:
    pieces = ["<think>I should call", " <tool_call> it</think>", '<tool_call>{"name": "f", "arguments": {}}',
              "</tool_call>"]
    whole = fed(pieces, tools=ToolCallParser("hermes"))
    asyncio.run(whole.gather())
    ((content, finish, _, calls, reasoning),) = whole.bodies()
    assert reasoning == "I should call <tool_call> it" and content is None and finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["f"]


def test_chat_template_kwargs_reach_the_template() -> None:
    template = _ChatTemplate("{{ 'thinking' if enable_thinking else 'plain' }}", {})
    assert template.apply_chat_template([], None, enable_thinking=True) == "thinking"
    assert template.apply_chat_template([], None, enable_thinking=False) == "plain"
    body = msgspec.convert({"messages": [], "chat_template_kwargs": {"messages": []}}, ChatCompletionRequest)
    with pytest.raises(ValueError, match="cannot set messages"):
        body.template_kwargs()


# -- a structured output after the reasoning -----------------------------------------------------


def test_the_constraint_starts_when_the_reasoning_closes() -> None:
    tok = ByteTokenizer()
    req = Request(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=64, temperature=0))
    req.constraint = guided = GuidedAnswer(Grammars(tok, 512).matcher(Guide("regex", "[0-9]+")), CLOSE)
    stream = OutputStream(req, tok)
    row = torch.zeros(512)
    row[ord("x")] = 5.0  # the model wants "x", which the constraint does not allow
    for ch in "<think>x > y":
        assert sample(row[None], [req], {})[0].token == ord("x")  # type: ignore[union-attr]
        assert stream.push(Sampled(ord(ch))).finish_reason is None
    for ch in "</think>":
        assert guided.thinking_until is not None
        stream.push(Sampled(ord(ch)))
    assert guided.thinking_until is None
    token = sample(row[None], [req], {})[0].token  # type: ignore[union-attr]
    assert chr(token).isdigit()  # the matcher starts fresh after the reasoning
    assert stream.push(Sampled(token)).finish_reason is None


@pytest.mark.parametrize("opens", [True, False])
def test_an_answer_that_may_reason_decides_at_its_first_token(opens: bool) -> None:
    """qwen3 with a prompt that neither opens nor closes the reasoning: the first token may open it
    (one token, as Qwen3's tokenizer has) or be the constraint's; either way the constraint holds."""
    tok, think = ByteTokenizer(), 300  # an id the byte vocabulary leaves free stands for "<think>"
    req = Request(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=64, temperature=0))
    req.constraint = guided = GuidedAnswer(Grammars(tok, 512).matcher(Guide("regex", "[0-9]+")),
                                           opens_thinking=[think], close=CLOSE)
    row = torch.zeros(512)
    row[ord("x")], row[think], row[ord("7")] = 5.0, 4.0 if opens else -4.0, 1.0
    first = sample(row[None], [req], {})[0].token  # type: ignore[union-attr]
    assert first == (think if opens else ord("7"))  # never "x", which the constraint does not allow
    OutputStream(req, tok).push(Sampled(first))
    assert guided.opens_thinking == [] and guided.thinking_until == (CLOSE if opens else None)
    nxt = sample(row[None], [req], {})[0].token  # type: ignore[union-attr]
    assert nxt == (ord("x") if opens else ord("7"))  # reasoning is free; a constrained answer goes on


@pytest.fixture(scope="module")
def engine(torch_single_thread: None) -> Iterator[Engine]:
    with module_engine(kv_capacity_tokens=16384, kv_block_size=64) as eng:
        yield eng


def post(app: Any, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post("/v1/chat/completions", json=body)
    return asyncio.run(asyncio.wait_for(go(), 60))


def test_a_worker_with_a_reasoning_parser(engine: Engine) -> None:
    """The embedded model's random weights never close a reasoning: under deepseek_r1 its answer is
    all reasoning, and a structured output asked for never starts; under qwen3 (its prompt opens no
    reasoning) the answer is content."""
    printable = {str(t): -100 for t in range(engine.model.cfg.vocab_size) if not 32 <= t < 127}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logit_bias": printable}
    plain = post(create_worker_app(engine, "m"), body).json()["choices"][0]["message"]["content"]
    r1 = post(create_worker_app(engine, "m", reasoning_parser="deepseek_r1"), body).json()["choices"][0]["message"]
    assert len(plain) == 12 and "</think>" not in plain
    assert r1["content"] is None and r1["reasoning_content"] == r1["reasoning"] == plain
    guided = post(create_worker_app(engine, "m", reasoning_parser="deepseek_r1"), body | {"guided_regex": "[0-9]"})
    assert guided.json()["choices"][0]["message"]["reasoning_content"] == plain  # unconstrained reasoning
    qwen3 = post(create_worker_app(engine, "m", reasoning_parser="qwen3"), body).json()["choices"][0]["message"]
    assert qwen3["content"] == plain and "reasoning_content" not in qwen3
    refused = post(create_worker_app(engine, "m"), body | {"chat_template_kwargs": {"tools": []}})
    assert refused.status_code == 400 and "chat_template_kwargs" in refused.json()["error"]["message"]
    assert json.dumps(r1)


def test_an_earlier_answers_reasoning_reaches_the_template() -> None:
    from engine.protocol.openai import ChatMessage

    said = ChatMessage(role="assistant", content="4", reasoning_content="two and two")
    assert said.for_template()["reasoning_content"] == "two and two"
    assert ChatMessage(role="assistant", content="4", reasoning="r").for_template()["reasoning_content"] == "r"
    assert "reasoning_content" not in ChatMessage(role="assistant", content="4").for_template()
