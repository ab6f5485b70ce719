"""`POST /v1/responses`, served on the chat path (engine/serving/generation.py; the request's translation is
engine/protocol/responses.py): the answer as OpenAI's response object, whole, or streamed as its events
(`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
`response.content_part.added`, the text, reasoning or arguments deltas and their `.done`,
`response.content_part.done`, `response.output_item.done`; last `response.completed`, or
`response.incomplete` when max_output_tokens cut it short, or `response.failed`), numbered by
`sequence_number`. Output items: the reasoning (with a reasoning parser), the message, and a
`function_call` per tool call."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from engine.protocol.openai import Unsupported
from engine.protocol.responses import ResponsesRequest
from engine.serving.choices import tool_delta
from engine.serving.endpoint import BadRequest, EventStream, decode_body
from engine.serving.generation import Generation
from engine.serving.stages import Started
from engine.serving.structured_output import failed_by_constraint
from engine.serving.tool_calls import ForcedCall


class ResponsesEndpoint:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def create(self, request: Request) -> Response | Stream:
        body = decode_body(await request.body(), ResponsesRequest)
        try:
            chat = body.as_chat()
        except Unsupported as exc:
            raise BadRequest(str(exc), param=exc.field, code="unsupported_parameter") from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        started = await self.generation.start(request, chat, chat=True, id_prefix="resp")
        if isinstance(started, Response):
            return started
        writer = ResponseWriter(started, self.generation.model, body)
        if body.stream:
            return EventStream(writer.events(), media_type="text/event-stream", headers=started.headers)
        if (failed := await self.generation.finish(request, started)) is not None:
            return failed
        return Response(writer.whole(), headers=started.headers)

    def handlers(self) -> list[Any]:
        return [post("/v1/responses", status_code=200)(self.create)]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": status}


class _Item:
    """An output item being written: a reasoning, a message or a function call."""

    def __init__(self, kind: str, index: int, call: dict[str, Any] | None = None) -> None:
        self.kind, self.index, self.call = kind, index, call
        self.id = _id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.text, self.logprobs = "", []  # type: tuple[str, list[dict[str, Any]]]

    def as_dict(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if self.kind == "message":
            content = [_output_text(self.text, self.logprobs)] if status != "in_progress" else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}
        assert self.call is not None
        return _call_item(self.id, self.call | {"function": self.call["function"] | {
            "arguments": self.text if status != "in_progress" else ""}}, status)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return _output_text(self.text, self.logprobs)


class ResponseWriter:
    """One request's response object, whole or as its stream of events."""

    def __init__(self, started: Started, model: str, request: ResponsesRequest) -> None:
        self.started, self.choices, self.model, self.request = started, started.choices, model, request
        self.created = int(time.time())
        self.seq = 0
        self.done: list[dict[str, Any]] = []  # the stream's finished output items, in order

    def response(self, status: str, output: list[dict[str, Any]], error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        r = self.request
        finished = status in ("completed", "incomplete")
        return {
            "id": self.started.rid, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if finished else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "service_tier": r.service_tier or "auto", "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_logprobs": r.top_logprobs or 0,
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled", "user": r.user,
            "metadata": r.metadata or {}, "background": False, "store": False,
            "usage": self.usage() if finished else None}

    def usage(self) -> dict[str, Any]:
        u = self.choices.usage()
        engine, first = self.choices.engine, self.started.first
        # the prompt's full KV blocks not found cached were written to the prefix cache (findable after)
        block = engine.kv.block_size
        written = (first.num_prompt_tokens // block * block - first.cached_tokens
                   if engine.cfg.prefix_caching and first.block_hashes is not None else 0)
        details = u["prompt_tokens_details"] | {"cache_write_tokens": max(0, written)}
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": details,
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.choices.reasoning_tokens[0]},
                "total_tokens": u["total_tokens"]}

    def whole(self) -> dict[str, Any]:
        content, finish, logprobs, calls, reasoning = self.choices.bodies()[0]
        status = "incomplete" if finish == "length" else "completed"
        output = []
        if reasoning is not None:
            output.append({"id": _id("rs"), "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text", "text": reasoning}], "status": status})
        if content or not (calls or reasoning is not None):
            output.append({"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
                           "content": [_output_text(content or "", logprobs and logprobs["content"])]})
        output += [_call_item(_id("fc"), call, status) for call in calls]
        return self.response(status, output)

    def event(self, type_: str, **fields: Any) -> bytes:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"

    async def events(self) -> AsyncIterator[bytes]:
        choices, current, finish = self.choices, None, None
        held: list[dict[str, Any]] = []  # logprobs of tokens whose text is held back (or has none), for the next
        shown = [0]  # with tools: how much of the text went out as content
        forced = choices.tools if isinstance(choices.tools, ForcedCall) and choices.tools.name else None
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            while not choices.done:
                _, out, reasoning = await choices.next()
                if out.finish_reason == "error":
                    kind = "invalid_prompt" if failed_by_constraint(out.error or "") else "server_error"
                    yield self.event("response.failed", response=self.response(
                        "failed", self.done, {"code": kind, "message": out.error or "engine error"}))
                    return
                text, finish, calls = out.text, out.finish_reason, None
                if choices.tools is not None and forced is None:
                    text, finish, calls = tool_delta(choices, 0, shown, finish)
                fmt = choices.formatters[0]
                held += fmt.format(out.logprobs or [])["content"] if fmt is not None else []
                for kind, delta in (("reasoning", reasoning), ("function_call" if forced else "message", text)):
                    if not delta:
                        continue
                    if current is None or current.kind != kind:
                        events = self._close(current, "completed")
                        current = self._open(kind, events, forced and {
                            "id": f"call_{uuid.uuid4().hex[:24]}", "function": {"name": forced.name}})
                        for ev in events:
                            yield ev
                    yield self._delta(current, delta, held if kind == "message" else [])
                    held = [] if kind == "message" else held
            status = "incomplete" if finish == "length" else "completed"
            for ev in self._finish(current, calls or [], status, held):
                yield ev
            yield self.event(f"response.{status}", response=self.response(status, self.done))
        finally:
            choices.cancel_unfinished()  # the client went away mid-stream, or the answer failed

    def _open(self, kind: str, events: list[bytes], call: dict[str, Any] | None = None) -> _Item:
        """A new output item; its opening events appended to `events`."""
        item = _Item(kind, len(self.done), call or None)
        events.append(self.event("response.output_item.added", output_index=item.index,
                                 item=item.as_dict("in_progress")))
        if kind != "function_call":
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=item.index,
                                     content_index=0, part=item.part()))
        return item

    def _delta(self, item: _Item, delta: str, logprobs: list[dict[str, Any]]) -> bytes:
        item.text += delta
        item.logprobs += logprobs
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            return self.event("response.function_call_arguments.delta", **at, delta=delta)
        if item.kind == "reasoning":
            return self.event("response.reasoning_text.delta", **at, content_index=0, delta=delta)
        return self.event("response.output_text.delta", **at, content_index=0, delta=delta, logprobs=logprobs)

    def _close(self, item: _Item | None, status: str) -> list[bytes]:
        if item is None:
            return []
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **at, arguments=item.text)]
        else:
            events = [self.event("response.reasoning_text.done", **at, content_index=0, text=item.text)
                      if item.kind == "reasoning" else
                      self.event("response.output_text.done", **at, content_index=0, text=item.text,
                                 logprobs=item.logprobs),
                      self.event("response.content_part.done", **at, content_index=0, part=item.part())]
        self.done.append(item.as_dict(status))
        return [*events, self.event("response.output_item.done", output_index=item.index, item=self.done[-1])]

    def _finish(self, current: _Item | None, calls: list[dict[str, Any]], status: str,
                held: list[dict[str, Any]]) -> list[bytes]:
        """The last item closed; the tool calls read back at the end, each an item; an answer that
        wrote nothing, an empty message. `held`: the logprobs no text delta carried yet."""
        events: list[bytes] = []
        if held and (current is None or current.kind != "message") and not calls:
            events += self._close(current, status)
            current = self._open("message", events)
        if current is not None and current.kind == "message":
            current.logprobs += held
        events += self._close(current, status)
        if not calls and not self.done:
            events += self._close(self._open("message", events), status)
        for call in calls:
            item = self._open("function_call", events, call)
            events.append(self._delta(item, call["function"]["arguments"], []))
            events += self._close(item, status)
        return events
