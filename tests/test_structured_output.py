"""Structured output (engine/serving/structured_output.py): the request fields that ask for it, the token
masks over the embedded byte-level vocabulary and over a BPE tokenizer.json (checked against the
tokens' own bytes), answers that match their constraint through a worker (whole, streamed, n
choices, completions, forced tool calls), a constrained greedy answer equal to one whose excluded
tokens were biased away, and eviction with a constraint."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import torch
from checkpoints import write_tokenizer
from helpers import EngineFactory, module_engine
from test_engine import Sink, assert_idle_and_free, tokens
from test_kv_growth import BS, Evictions

from engine.core.decode import OutputStream
from engine.core.engine import Engine
from engine.core.request import Request, Sampled, SamplingParams
from engine.core.tokenizer import ByteTokenizer, HFTokenizer
from engine.protocol.openai import ChatCompletionRequest, CompletionRequest, Unsupported
from engine.serving.structured_output import Grammars, Guide, GuidedAnswer, allowed_logits
from engine.serving.tool_calls import ForcedCall
from engine.serving.worker import create_worker_app

pytest.importorskip("llguidance")

MESSAGES = [{"role": "user", "content": "Answer in the format asked for."}]
# The embedded model's weights are random: left free, it pads JSON with whitespace until max_tokens.
# These ids (the byte tokenizer's whitespace) are biased away where a test needs the JSON to end.
NO_WHITESPACE = {str(b): -100 for b in b" \t\n\r"}
PERSON = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "busy"]}},
          "required": ["ok", "mood"], "additionalProperties": False}


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": MESSAGES} | fields, ChatCompletionRequest)


# -- the request fields -------------------------------------------------------------------------


def test_every_spelling_asks_for_the_same_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spelled = [chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
               chat(structured_outputs={"json": schema}), chat(structured_outputs={"json": json.dumps(schema)}),
               chat(guided_json=schema), chat(guided_json=json.dumps(schema))]
    assert {r.guide() for r in spelled} == {Guide.json(schema)}
    assert chat(response_format={"type": "json_object"}).guide() == Guide("json", '{"type": "object"}')
    compact = chat(structured_outputs={"json_object": True, "disable_any_whitespace": True}).guide()
    assert compact is not None and not compact.any_whitespace
    assert chat(guided_regex="[0-9]+").guide() == chat(structured_outputs={"regex": "[0-9]+"}).guide() == Guide(
        "regex", "[0-9]+")
    assert chat(guided_choice=["a", "b"]).guide() == Guide("choice", '["a", "b"]')
    assert chat(guided_grammar='root ::= "x"').guide() == Guide("grammar", 'root ::= "x"')
    assert chat(guided_json={}, guided_whitespace_pattern=" ?").guide().whitespace_pattern == " ?"  # type: ignore[union-attr]
    assert chat(response_format={"type": "text"}).guide() is None and chat().guide() is None
    # completions take them too
    assert msgspec.convert({"prompt": "x", "guided_regex": "a"}, CompletionRequest).sampling(4).guide == Guide(
        "regex", "a")


@pytest.mark.parametrize(("fields", "message"), [
    ({"guided_json": {}, "guided_regex": "a"}, "one structured output at most"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "one structured output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"guided_json": "{not json"}, "not JSON"),
    ({"guided_json": [1]}, "must be an object"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_regex": ""}, "non-empty string"),
])
def test_malformed_requests_are_value_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chat(**fields).sampling(16)


def test_refused_fields() -> None:
    assert chat(response_format={"type": "structural_tag"}).unsupported() == "response_format"
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        chat(structured_outputs={"structural_tag": "x"})
    weather = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=weather, tool_choice="required").unsupported(tool_calls=False) is None
    assert chat(tools=weather).unsupported(tool_calls=False) == "tools"  # "auto" needs a parser
    assert msgspec.convert({"prompt": "x", "tool_choice": "required"}, CompletionRequest).unsupported() == "tools"
    with pytest.raises(Unsupported):
        msgspec.convert({"prompt": "x", "tools": weather, "tool_choice": "required"}, CompletionRequest).sampling(4)


# -- masks over a vocabulary ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    path = write_tokenizer(tmp_path_factory.mktemp("bpe"))
    tok = HFTokenizer(path, [])
    return tok


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_the_mask_allows_exactly_the_tokens_that_continue_the_match(which: str, bpe: HFTokenizer) -> None:
    """Against the tokens' own bytes: after "ab", a regex of 3 to 12 letters or spaces then a full
    stop allows the tokens whose bytes are 1 to 10 of those, maybe followed by the full stop; the
    end-of-sequence only once the match is complete."""
    tok = ByteTokenizer() if which == "bytes" else bpe
    vocab = tok.vocab_size + 7  # a model's embedding is often padded past its tokenizer
    matcher = Grammars(tok, vocab).matcher(Guide("regex", "[a-z ]{3,12}[.]"))
    for t in tok.encode("ab"):
        assert matcher.consume_token(t)
    allowed = torch.isfinite(allowed_logits(torch.zeros(vocab), matcher)).nonzero().flatten().tolist()
    follows = re.compile(rb"[a-z ]{1,10}\.?")
    expected = [t for t in range(tok.vocab_size) if follows.fullmatch(tok.token_bytes(t))]
    assert len(expected) >= 27 if which == "bytes" else len(expected) > 100  # BPE merged words
    assert allowed == expected
    for t in tok.encode("c."):
        assert matcher.consume_token(t)
    assert matcher.is_stopped()


def test_invalid_constraints_name_what_is_wrong() -> None:
    grammars = Grammars(ByteTokenizer(), 512)
    for guide, message in [(Guide("json", '{"type": "foo"}'), "invalid JSON schema"),
                           (Guide("regex", "("), "invalid regular expression"),
                           (Guide("grammar", "root ::= ("), "invalid grammar"),
                           (Guide("choice", "not json"), "invalid choice")]:
        with pytest.raises(ValueError, match=message):
            grammars.matcher(guide)


def test_a_token_the_matcher_refuses_ends_the_answer_with_an_error() -> None:
    tok = ByteTokenizer()
    req = Request(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=8))
    req.constraint = GuidedAnswer(Grammars(tok, 512).matcher(Guide("regex", "[0-9]+")))
    out = OutputStream(req, tok).push(Sampled(ord("a")))
    assert out.finish_reason == "error" and "rejected token 97" in (out.error or "")


# -- through a worker -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(torch_single_thread: None) -> Iterator[tuple[Engine, Any]]:
    with module_engine(kv_capacity_tokens=16384, kv_block_size=64) as eng:
        yield eng, create_worker_app(eng, "m")


def post(app: Any, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post(path, json=body)
    return asyncio.run(asyncio.wait_for(go(), 60))


def events(app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    async def go() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return (await c.post("/v1/chat/completions", json=body | {"stream": True})).text
    text = asyncio.run(asyncio.wait_for(go(), 60))
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def answer(app: Any, **fields: Any) -> tuple[str, str]:
    r = post(app, {"messages": MESSAGES, "max_tokens": 40, "temperature": 0} | fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_answers_match_their_constraint(worker: tuple[Engine, Any]) -> None:
    eng, app = worker
    text, finish = answer(app, guided_regex="[0-9]{3}-[a-z]{2,3}")
    assert re.fullmatch("[0-9]{3}-[a-z]{2,3}", text) and finish == "stop"
    text, finish = answer(app, guided_choice=["alpha", "beta", "gamma"])
    assert text in ("alpha", "beta", "gamma") and finish == "stop"
    text, finish = answer(app, structured_outputs={"grammar": 'root ::= "(" [a-c]{1,3} ")"'})
    assert re.fullmatch(r"\([a-c]{1,3}\)", text) and finish == "stop"
    schema = {"name": "person", "schema": PERSON, "strict": True}
    text, finish = answer(app, response_format={"type": "json_schema", "json_schema": schema}, logit_bias=NO_WHITESPACE)
    value = json.loads(text)
    assert finish == "stop" and isinstance(value["ok"], bool) and value["mood"] in ("calm", "busy")
    assert set(value) == {"ok", "mood"}
    compact, finish = answer(app, structured_outputs={"json": PERSON, "disable_any_whitespace": True})
    assert json.loads(compact) == json.loads(compact) and " " not in compact and finish == "stop"
    # cut short, the answer is what it had so far: a prefix of a match
    text, finish = answer(app, guided_regex="[a-z]{50}", max_tokens=5)
    assert re.fullmatch("[a-z]{5}", text) and finish == "length"
    assert_idle_and_free(eng)


def test_a_constrained_greedy_answer_equals_one_with_the_rest_biased_away(worker: tuple[Engine, Any]) -> None:
    """The reference: printable ASCII as a regex, and the same set of tokens as a -100 logit bias on
    every other token (the end-of-sequence ids, which the regex allows at any point, left alone)."""
    eng, app = worker
    tok = eng.tokenizer
    others = {str(t): -100 for t in range(eng.model.cfg.vocab_size)
              if not 32 <= t < 127 and t not in tok.eos_token_ids}
    constrained, _ = answer(app, guided_regex="[ -~]*", max_tokens=48, ignore_eos=True)
    biased, _ = answer(app, logit_bias=others, max_tokens=48, ignore_eos=True)
    free, _ = answer(app, max_tokens=48, ignore_eos=True)
    assert constrained == biased != free  # the model left alone writes other bytes
    assert re.fullmatch("[ -~]*", constrained) and len(constrained) == 48


def test_streamed_n_choices_and_completions(worker: tuple[Engine, Any]) -> None:
    _, app = worker
    regex = "(yes|no), [a-z]{1,8}\\."
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": 3, "guided_regex": regex, "n": 3}
    whole = post(app, body).json()["choices"]
    assert len(whole) == 3 and all(re.fullmatch(regex, c["message"]["content"]) for c in whole)
    assert len({c["message"]["content"] for c in whole}) > 1  # each choice has a matcher of its own
    streamed = events(app, body)
    texts = ["".join(e["choices"][0]["delta"].get("content") or "" for e in streamed
                     if e["choices"][0]["index"] == i) for i in range(3)]
    assert texts == [c["message"]["content"] for c in whole]
    completion = post(app, {"prompt": "Digits: ", "max_tokens": 10, "temperature": 0, "guided_regex": "[0-9]{4}"},
                      "/v1/completions").json()["choices"][0]
    assert re.fullmatch("[0-9]{4}", completion["text"]) and completion["finish_reason"] == "stop"


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_forced_tool_calls(worker: tuple[Engine, Any]) -> None:
    _, app = worker
    base = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0, "tools": TOOLS, "logit_bias": NO_WHITESPACE}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post(app, base | {"tool_choice": named}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["message"]["content"] is None  # OpenAI's for a named call
    (named_call,) = r["message"]["tool_calls"]
    assert named_call["function"]["name"] == "get_weather"
    assert json.loads(named_call["function"]["arguments"])["city"] in ("Oslo", "Lima")
    # one call: the model would go on adding calls to the list (random weights)
    r = post(app, base | {"tool_choice": "required", "parallel_tool_calls": False}).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls", r
    (call,) = r["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time")
    # streamed as OpenAI streams calls: the call with its name first, then its arguments as written
    streamed = events(app, base | {"tool_choice": named})
    deltas = [e["choices"][0]["delta"] for e in streamed]
    assert not any(d.get("content") for d in deltas)
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if d.get("tool_calls")]
    assert len(pieces) > 5 and "".join(pieces) == named_call["function"]["arguments"]  # as the whole answer's
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:] if d.get("tool_calls"))
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("fields", "status", "message"), [
    ({"guided_json": {"type": "foo"}}, 400, "invalid JSON schema"),
    ({"guided_regex": "("}, 400, "invalid regular expression"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, 400, "one structured output"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "not among the tools"),
    ({"tool_choice": "required"}, 400, "no tools are given"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, 400, "cannot be combined"),
    ({"response_format": {"type": "structural_tag"}}, 400, "response_format must be"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, 400, "unknown field"),
])
def test_bad_constraints_are_400s(worker: tuple[Engine, Any], fields: dict[str, Any], status: int,
                                  message: str) -> None:
    eng, app = worker
    r = post(app, {"messages": MESSAGES, "max_tokens": 4} | fields)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert eng.num_waiting == 0 and not eng.has_request(r.headers.get("x-request-id", "-"))


def required_cut_is_content() -> bool:
    return ForcedCall(TOOLS, "required").parse('[{"name": "get_time", "parameters": {') == (
        '[{"name": "get_time", "parameters": {', [])


def test_forced_call_reader() -> None:
    named = ForcedCall(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert json.loads(named.guide.spec) == {"type": "object"} and named.finish_reason == "stop"
    content, calls = named.parse("{}")
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert named.parse('{"cut')[1][0]["function"]["arguments"] == '{"cut'  # cut short: as written, as vLLM's
    assert required_cut_is_content()
    required = ForcedCall(TOOLS, "required")
    _, calls = required.parse('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", '
                              '"parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]


# -- with eviction --------------------------------------------------------------------------------


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_block_size=BS, kv_capacity_tokens=64 * BS)
    yield factory
    factory.close()


def test_evicted_constrained_answers_resume_where_their_matcher_was(make_engine: EngineFactory) -> None:
    """The matcher lives on the request: an answer evicted and recomputed goes on matching, and equals
    the answer of an engine with room for all."""
    small, big = make_engine(kv_capacity_tokens=24 * BS), make_engine()
    evictions = Evictions(small)
    guide = Guide("regex", "([a-z]+ ){20,}")
    got, want = [], []
    for eng, out in ((small, got), (big, want)):
        grammars = Grammars(eng.tokenizer, eng.model.cfg.vocab_size)
        for i in range(6):
            sampling = {"temperature": 0.8, "seed": i} if i % 2 else {}
            out.append(_guided(eng, grammars, guide, i, sampling))
    for (req, sink), (ref, ref_sink) in zip(got, want, strict=True):
        assert sink.wait() == ref_sink.wait() == "length"
        assert req.output_token_ids == ref.output_token_ids
        assert re.fullmatch("([a-z]+ )*[a-z]*", small.tokenizer.decode(req.output_token_ids))
    assert evictions.requests
    for eng in (small, big):
        assert_idle_and_free(eng)


def _guided(eng: Engine, grammars: Grammars, guide: Guide, i: int, sampling: dict[str, Any]) -> tuple[Request, Sink]:
    req = Request(request_id=f"r{i}", prompt_token_ids=tokens(30 + 7 * i, seed=10 + i), sampling=SamplingParams(
        max_tokens=70, ignore_eos=True, guide=guide, **{"temperature": 0.0, **sampling}))  # type: ignore[arg-type]
    req.constraint = GuidedAnswer(grammars.matcher(guide))
    req.sink = sink = Sink(req)
    eng.add_request(req)
    return req, sink


def test_the_request_span_says_what_the_answer_was_held_to(make_engine: EngineFactory) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from telemetry.tracing import EngineTracer

    eng = make_engine()
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = EngineTracer(eng, "tiny")
    tracer.tracer = provider.get_tracer("test")
    grammars = Grammars(eng.tokenizer, eng.model.cfg.vocab_size)
    for i, guide in enumerate([Guide.json({"type": "object"}), Guide.choice(["a", "b"]), None]):
        req = Request(request_id=f"s{i}", prompt_token_ids=tokens(20, seed=i),
                      sampling=SamplingParams(max_tokens=4, temperature=0.0, guide=guide))
        req.constraint = guide and GuidedAnswer(grammars.matcher(guide))
        req.sink = sink = Sink(req)
        tracer.start(req, "chat")
        eng.add_request(req)
        sink.wait()
    roots = {s.attributes["flowprefill.request_id"]: s.attributes for s in exporter.get_finished_spans()
             if s.name == "chat tiny"}
    assert (roots["s0"]["gen_ai.output.type"], roots["s0"]["flowprefill.structured_output"]) == ("json", "json")
    assert (roots["s1"]["gen_ai.output.type"], roots["s1"]["flowprefill.structured_output"]) == ("text", "choice")
    assert "gen_ai.output.type" not in roots["s2"]


# -- found by review ------------------------------------------------------------------------------


@pytest.mark.parametrize(("guide", "message"), [
    (Guide("regex", "[^\\s\\S]"), "invalid regular expression"),  # matches nothing
    (Guide("grammar", "start: start"), "invalid grammar"),  # never ends
    (Guide.json({"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}), "invalid JSON"),
    (Guide("json", '{"type": "object", "properties": {"a": {"type": "string"}}}' + " " * 10), None),
])
def test_a_constraint_that_fails_on_its_first_mask_is_refused_at_once(guide: Guide, message: str | None) -> None:
    """llguidance finds some errors only when it computes a mask; in its error state it would allow
    just the end, and the answer would look complete."""
    grammars = Grammars(ByteTokenizer(), 512)
    if message is None:
        grammars.matcher(guide)
        return
    with pytest.raises(ValueError, match=message):
        grammars.matcher(guide)


def test_schemas_the_ecosystem_writes() -> None:
    grammars = Grammars(ByteTokenizer(), 512)
    grammars.matcher(Guide.json({"oneOf": [{"type": "integer"}, {"type": "string"}]}))  # pydantic's unions
    assert Guide.json(True) == Guide.json({})
    closed = json.loads(Guide.json({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}},
                                   close_objects=True).spec)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert chat(structured_outputs={"json": {"properties": {}}, "disable_additional_properties": True}).guide() == (
        Guide.json({"properties": {}, "additionalProperties": False}))
    with pytest.raises(ValueError, match="nested too deeply"):
        Guide.json('{"items":' * 3000 + "{}" + "}" * 3000)
    # a "required" call over tools whose parameters use definitions: they move to the root
    nested = {"$defs": {"C": {"enum": ["Oslo"]}}, "type": "object", "properties": {"city": {"$ref": "#/$defs/C"}}}
    forced = ForcedCall([{"type": "function", "function": {"name": "f", "parameters": nested}}], "required")
    assert json.loads(forced.guide.spec)["$defs"] == {"C": {"enum": ["Oslo"]}}
    grammars.matcher(forced.guide)
    other = {"$defs": {"C": {"enum": ["Lima"]}}, "properties": {"c": {"$ref": "#/$defs/C"}}}
    with pytest.raises(ValueError, match="define 'C' differently"):
        ForcedCall([{"type": "function", "function": {"name": "f", "parameters": nested}},
                    {"type": "function", "function": {"name": "g", "parameters": other}}], "required")
    with pytest.raises(ValueError, match="two tools are named"):
        ForcedCall([{"type": "function", "function": {"name": "f"}}] * 2, "required")


def test_the_end_is_held_back_under_ignore_eos_unless_nothing_else_may_come() -> None:
    tok = ByteTokenizer()
    eos = tok.eos_token_ids
    matcher = Grammars(tok, 512).matcher(Guide("regex", "a?"))
    allowed = torch.isfinite(allowed_logits(torch.zeros(512), matcher, eos))
    assert allowed.nonzero().flatten().tolist() == [ord("a")]  # the end would be allowed: "" matches
    matcher.consume_token(ord("a"))
    assert torch.isfinite(allowed_logits(torch.zeros(512), matcher, eos)).nonzero().flatten().tolist() == eos


@pytest.mark.parametrize(("fields", "status", "message"), [
    ({"guided_regex": "a{4294967295}"}, 400, "structured output"),  # fails at its first token
    ({"guided_grammar": 'start: "ab" x\nx: x'}, 400, "structured output"),  # fails after "ab"
    ({"tools": TOOLS, "tool_choice": "bogus"}, 400, "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": 5}, 400, "tool_choice must be"),
    ({"guided_json": '{"items":' * 3000 + "{}" + "}" * 3000}, 400, "nested too deeply"),
    ({"guided_regex": "()", "min_tokens": 2}, 200, ""),  # the constraint wins over min_tokens: it ends
    ({"guided_regex": "a+", "stop_token_ids": [97], "min_tokens": 2, "temperature": 1.0}, 200, ""),
])
def test_constraints_that_fail_while_generating(worker: tuple[Engine, Any], fields: dict[str, Any], status: int,
                                                message: str) -> None:
    eng, app = worker
    r = post(app, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0} | fields)
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        assert "\n" not in error["message"]  # llguidance's own dump of its state stays out
    else:
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert_idle_and_free(eng)


def test_a_deeply_nested_body_is_a_400(worker: tuple[Engine, Any]) -> None:
    _, app = worker
    deep = '{"messages": [{"role": "user", "content": "x"}], "guided_json": ' + '{"a":' * 5000 + "1" + "}" * 5001
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
    r = asyncio.run(go())
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


def test_a_costly_grammar_fails_alone(worker: tuple[Engine, Any]) -> None:
    """An ambiguous grammar grows costlier with every token, on the engine thread that every answer
    waits for: past STEP_CPU_LIMIT_S of CPU for one token it fails, and the others go on."""
    eng, app = worker

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            base = {"messages": MESSAGES, "max_tokens": 400, "temperature": 0}
            return list(await asyncio.gather(
                c.post("/v1/chat/completions", json=base | {"guided_grammar": 'start: x\nx: x x | x x x | "a"'}),
                c.post("/v1/chat/completions", json=base | {"max_tokens": 60, "ignore_eos": True})))
    costly, plain = asyncio.run(asyncio.wait_for(both(), 120))
    assert costly.status_code == 400 and "too costly to follow" in costly.json()["error"]["message"]
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 60
    assert_idle_and_free(eng)


def test_a_reused_request_id_still_gets_a_suffix(worker: tuple[Engine, Any]) -> None:
    """Compiling awaits: it happens before the id is made unique, or two requests of one id race."""
    _, app = worker

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "guided_regex": "[a-z]{8}"}
            return list(await asyncio.gather(*(c.post("/v1/chat/completions", json=body,
                                                      headers={"x-request-id": "same"}) for _ in range(2))))
    responses = asyncio.run(asyncio.wait_for(both(), 60))
    assert [r.status_code for r in responses] == [200, 200]
    assert sorted(r.json()["id"] == "same" for r in responses) == [False, True]
