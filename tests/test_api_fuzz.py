"""Random combinations of the request fields that interact (echo, logprobs and prompt_logprobs,
max_tokens 0, n, batched prompts, streaming, min_tokens, stop, every spelling of structured output,
tools and tool_choice, chat_template_kwargs, reasoning parsers), valid and not, against one worker:
every answer is a 200 or an OpenAI 400, never a server error; every stream ends with [DONE] and no
error event; and afterwards nothing waits, decodes or holds a KV block. A fixed seed: a failure
reproduces."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import module_engine
from test_engine import assert_idle_and_free

from engine.core.engine import Engine
from engine.serving.worker import create_worker_app

REQUESTS = 600
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"], "additionalProperties": False}}}
FIELDS: dict[str, list[Any]] = {
    "echo": [True, False], "logprobs": [0, 1, 5, 21, -1], "prompt_logprobs": [0, 2, 25, -1],
    "max_tokens": [0, 1, 3, 6, -1], "max_completion_tokens": [0, 2], "n": [1, 2, 3, 0], "stream": [True, False],
    "min_tokens": [0, 1, 3], "temperature": [0, 0.7], "seed": [1], "ignore_eos": [True], "stop": [["a"], "b"],
    "guided_regex": ["[a-z]{2,4}", "(", "a*", "[^\\s\\S]"], "guided_choice": [["yes", "no"], []],
    "guided_json": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                    {"type": "foo"}, "{", 5],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "bogus"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a", "b"]}}}],
    "structured_outputs": [{"regex": "[0-9]+", "disable_any_whitespace": True}, {"json_object": True},
                           {"grammar": 'root ::= "x"'}, {"bogus": 1}],
    "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}, "bad"],
    "tools": [[TOOL], [{"x": 1}]], "parallel_tool_calls": [False],
    "chat_template_kwargs": [{"enable_thinking": False}, {"messages": 1}],
}
PROMPTS = ["hi", "a" * 50, [65, 66], [[65], [66, 67]], ["x", "yy"], ["a"] * 3]
BAD_PROMPTS = ["", [], [["x"]], [65, 10**6], [[]], [1.5], 5]
MESSAGES = [[{"role": "user", "content": "hi"}], [],
            [{"role": "assistant", "content": "x", "reasoning_content": "r"}, {"role": "user", "content": "y"}]]


def body(rng: random.Random, chat: bool) -> dict[str, Any]:
    out = {k: rng.choice(values) for k, values in FIELDS.items() if rng.random() < 0.12}
    if chat:
        out["messages"] = rng.choice(MESSAGES[:1] * 4 + MESSAGES)
        if "max_tokens" not in out and "max_completion_tokens" not in out:
            out["max_tokens"] = 8  # a chat answer runs to 1,024 tokens without (the embedded model never ends)
    else:
        out["prompt"] = rng.choice(PROMPTS) if rng.random() < 0.8 else rng.choice(BAD_PROMPTS)
    return out


@pytest.fixture(scope="module")
def engine(torch_single_thread: None) -> Iterator[Engine]:
    with module_engine(kv_capacity_tokens=4096, kv_block_size=16, max_waiting=64) as eng:
        yield eng


def test_field_combinations_never_fail_the_server(engine: Engine) -> None:
    apps = [create_worker_app(engine, "m"),
            create_worker_app(engine, "m", tool_call_parser="hermes", reasoning_parser="qwen3"),
            create_worker_app(engine, "m", reasoning_parser="deepseek_r1")]
    rng = random.Random(20261130)
    statuses: dict[int, int] = {}

    async def run() -> None:
        for _ in range(REQUESTS):
            chat = rng.random() < 0.5
            sent = body(rng, chat)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=rng.choice(apps)), base_url="http://w",
                                         timeout=60) as c:
                r = await c.post("/v1/chat/completions" if chat else "/v1/completions", json=sent)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            about = json.dumps(sent)[:300]
            assert r.status_code in (200, 400), (about, r.text[:300])
            if r.status_code == 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, about
            elif sent.get("stream"):
                assert r.text.endswith("data: [DONE]\n\n") and '"server_error"' not in r.text, (about, r.text[-300:])
            else:
                assert r.json()["choices"], about

    asyncio.run(run())
    assert statuses.get(200, 0) > REQUESTS // 4, statuses  # enough valid combinations to mean something
    assert_idle_and_free(engine)
