"""One OpenAI request's answer from the engine's outputs. A request asking for `n` choices is `n`
engine requests (one per choice, the same prompt: after the first prefill the others find its
blocks in the prefix cache when they come later); their outputs share one queue and are gathered
here into a response body, or relayed as server-sent events with each choice's index."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from engine.core.engine import Engine
from engine.core.request import Logprob, Request, TokenOutput
from engine.protocol.openai import StreamOptions, error_body
from engine.serving.reasoning import ReasoningStream
from engine.serving.structured_output import failed_by_constraint
from engine.serving.tool_calls import ForcedCall, ToolCallParser


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # OpenAI's: prompt tokens found cached


def completion_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False,
                     logprobs: dict[str, Any] | None = None, index: int = 0,
                     tool_calls: list[dict[str, Any]] | None = None, reasoning: str = "") -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if tool_calls or reasoning:  # calls streamed as OpenAI's: each whole, with its index among them
            delta = ({"role": "assistant"} if first else {}) | _reasoning(reasoning) | (
                {"content": text} if text else {}) | ({"tool_calls": [{"index": i} | call for i, call in
                                                                       enumerate(tool_calls)]} if tool_calls else {})
        choice = {"index": index, "delta": delta if text or first or tool_calls or reasoning else {},
                  "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


Choice = tuple[str | None, str | None, dict[str, Any] | None, list[dict[str, Any]], str | None]


def _reasoning(text: str | None) -> dict[str, str]:
    """A reasoning model's reasoning under both names clients read: `reasoning_content` (DeepSeek's,
    SGLang's, vLLM's before 0.11) and `reasoning` (vLLM's since)."""
    return {} if not text else {"reasoning_content": text, "reasoning": text}


def completion_body(rid: str, model: str, choices: list[Choice], chat: bool, usage_: dict[str, Any]) -> dict[str, Any]:
    """`choices`: each one's text, finish reason, logprobs, tool calls and reasoning, in index order."""
    if chat:
        body = [{"index": i, "message": {"role": "assistant", "content": text} | _reasoning(reasoning)
                 | ({"tool_calls": calls} if calls else {}), "logprobs": lp, "finish_reason": f}
                for i, (text, f, lp, calls, reasoning) in enumerate(choices)]
        obj = "chat.completion"
    else:
        body = [{"index": i, "text": text, "logprobs": lp, "finish_reason": f}
                for i, (text, f, lp, _, _) in enumerate(choices)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": body, "usage": usage_}


class LogprobFormatter:
    """Logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
    and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`, whose top_logprobs hold
    the sampled token too when it is not among the likeliest (up to logprobs + 1 entries, as OpenAI's
    and vLLM's). `bytes` are exactly what the token stands for (`Tokenizer.token_bytes`); its string
    is them as UTF-8, with a piece of a multi-byte character written as escapes (`\\xe2`), as OpenAI's.
    Completions' text offsets add up those strings and carry on across a stream's chunks."""

    FLOOR = -9999.0  # vLLM's: a token of probability 0 (-inf) would be encoded as null

    def __init__(self, token_bytes: Callable[[int], bytes], chat: bool) -> None:
        self.token_bytes, self.chat, self.offset = token_bytes, chat, 0

    def _text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self._text(token_id), "logprob": max(logprob, self.FLOOR),
                "bytes": list(self.token_bytes(token_id))}

    def format_prompt(self, token_ids: list[int], entries: list[Logprob | None], top: int) -> dict[str, Any]:
        """Completions' echoed prompt: each prompt token's entry with its `top` likeliest, null for the
        first (nothing comes before it), as OpenAI's legacy API writes them."""
        entries = [None] * (len(token_ids) - len(entries)) + entries  # a one-token prompt has none
        tokens = [self._text(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else max(e.logprob, self.FLOOR) for e in entries],
                "top_logprobs": [None if e is None else {self._text(t): max(lp, self.FLOOR)
                                                         for t, lp in (*e.top[:top], (e.token_id, e.logprob))}
                                 for e in entries],
                "text_offset": offsets}

    def format(self, entries: list[Logprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._entry(e.token_id, e.logprob)
                                | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}
        tokens = [self._text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        tops = [{self._text(t): max(lp, self.FLOOR) for t, lp in (*e.top, (e.token_id, e.logprob))} for e in entries]
        return {"tokens": tokens, "token_logprobs": [max(e.logprob, self.FLOOR) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}


class Choices:
    """The engine requests of one response, in choice order, and what they have produced."""

    def __init__(self, engine: Engine, reqs: list[Request], queue: asyncio.Queue[TokenOutput],
                 formatter: Callable[[], LogprobFormatter] | None, tools: ToolCallParser | ForcedCall | None = None,
                 reasoning: Callable[[], ReasoningStream] | None = None, echo: list[str] | None = None,
                 prompt_k: int | None = None) -> None:
        """`tools`: what reads the model's tool calls, when the request offered it tools. `reasoning`:
        a reasoning model's splitter of reasoning from content, one per choice. `echo`: completions'
        prompt texts (one per prompt: n choices each), given back before each choice's completion
        (with logprobs, its tokens' first). `prompt_k`: vLLM's prompt_logprobs, when asked for."""
        self.engine, self.reqs, self.queue, self.tools, self.echo = engine, reqs, queue, tools, echo
        self.prompt_k = prompt_k
        self.index = {r.request_id: i for i, r in enumerate(reqs)}
        # a formatter each: completions' text offsets run on per choice
        self.formatters = [formatter and formatter() for _ in reqs]
        self.thoughts = [reasoning and reasoning() for _ in reqs]
        self.texts: list[list[str]] = [[] for _ in reqs]  # the content (with no reasoning model, all the text)
        self.reasoning: list[list[str]] = [[] for _ in reqs]
        self.logprobs: list[list[Logprob]] = [[] for _ in reqs]
        self.finish: list[str | None] = [None] * len(reqs)
        self.reasoning_tokens = [0] * len(reqs)  # those written while the reasoning was open (its tags too)
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(self.finish)

    async def next(self) -> tuple[int, TokenOutput, str]:
        """The next output, of choice i, with its text as content and its reasoning delta apart."""
        out = await self.queue.get()
        i = self.index[out.request_id]
        reasoning = ""
        if (thoughts := self.thoughts[i]) is not None:
            was_reasoning = thoughts.content_from is None
            reasoning, content = thoughts.push(out.text, final=out.finish_reason is not None)
            if was_reasoning or thoughts.content_from is None:
                self.reasoning_tokens[i] += len(out.token_ids)
            self.reasoning[i].append(reasoning)
            out = msgspec.structs.replace(out, text=content)
        self.texts[i].append(out.text)
        self.logprobs[i] += out.logprobs or []
        if out.finish_reason:
            self.finish[i] = out.finish_reason
            if out.finish_reason == "error":
                self.error = out.error or "engine error"
        return i, out, reasoning

    async def gather(self) -> None:
        """Until every choice is finished, or one failed (the others are then cancelled)."""
        try:
            while not self.done:
                await self.next()
        finally:
            self.cancel_unfinished()  # the handler was cancelled (client gone), or a choice failed

    def cancel_unfinished(self) -> None:
        for r, finish in zip(self.reqs, self.finish, strict=True):
            if finish is None:
                self.engine.cancel(r.request_id)

    def bodies(self) -> list[Choice]:
        """Each choice's content, finish reason, formatted logprobs, tool calls and reasoning."""
        out: list[Choice] = []
        for req, t, f, lp, fmt, thoughts, r in zip(self.reqs, self.texts, self.finish, self.logprobs, self.formatters,
                                                   self.thoughts, self.reasoning, strict=True):
            content: str | None = "".join(t)
            content, calls = self.tools.parse(content) if self.tools else (content, [])
            reasoning = "".join(r) if thoughts is not None and thoughts.thinking else None
            echoed = self._echoed(req, fmt)  # first: the prompt's logprobs come before the completion's
            formatted = fmt and fmt.format(lp)
            if echoed:
                content = echoed[0] + (content or "")
                formatted = formatted and _joined(echoed[1], formatted)
            finish = self.tools.finish_reason if calls and self.tools and f == "stop" else f  # "length" stays
            out.append((content or (None if reasoning is not None else content), finish, formatted, calls, reasoning))
        return out

    def _echoed(self, req: Request, fmt: LogprobFormatter | None) -> tuple[str, dict[str, Any] | None] | None:
        """The echoed prompt's text and (with logprobs) its tokens' entries, for a choice's first text."""
        if self.echo is None:
            return None
        text = self.echo[self.index[req.request_id] * len(self.echo) // len(self.reqs)]
        return text, fmt and fmt.format_prompt(req.prompt_token_ids, req.prompt_token_logprobs,
                                               req.sampling.logprobs or 0)

    def prompt_logprobs(self, req: Request) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, else by token id (a string
        key in JSON) its logprob, rank and text, for the token and the `prompt_k` likeliest."""
        def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
            text = self.engine.tokenizer.token_bytes(token).decode("utf-8", errors="replace")
            return {"logprob": max(logprob, LogprobFormatter.FLOOR), "rank": rank, "decoded_token": text}
        entries = req.prompt_token_logprobs
        out: list[dict[str, dict[str, Any]] | None] = [None] * (len(req.prompt_token_ids) - len(entries))
        for e in entries:
            out.append(None if e is None else {str(t): entry(t, lp, i + 1) for i, (t, lp) in enumerate(
                e.top[:self.prompt_k or 0])} | {str(e.token_id): entry(e.token_id, e.logprob, e.rank)})
        return out

    def with_prompt_logprobs(self, body: dict[str, Any], chat: bool, i: int | None = None) -> dict[str, Any]:
        """A response body or chunk with vLLM's prompt_logprobs when asked for: in chat at the top
        (one prompt), in completions on each choice (on chunk i's, when streaming)."""
        if self.prompt_k is None:
            return body
        if chat:
            return body | {"prompt_logprobs": self.prompt_logprobs(self.reqs[0])}
        for choice in body["choices"]:
            choice["prompt_logprobs"] = self.prompt_logprobs(self.reqs[choice["index"] if i is None else i])
        return body

    def usage(self, sent: int | None = None) -> dict[str, Any]:
        """Each prompt counted once (as OpenAI does for n choices), the completions' tokens summed."""
        firsts = [r for r in self.reqs if not r.choice]
        done = sum(len(r.output_token_ids) for r in self.reqs) if sent is None else sent
        return usage(sum(r.num_prompt_tokens for r in firsts), done, sum(r.cached_tokens for r in firsts))


async def sse(choices: Choices, rid: str, model: str, chat: bool, options: StreamOptions) -> AsyncIterator[bytes]:
    first, sent = [True] * len(choices.reqs), 0
    shown = [0] * len(choices.reqs)  # with tools: how much of each choice's text went out as content
    try:
        while not choices.done:
            i, out, reasoning = await choices.next()
            sent += len(out.token_ids)
            if out.finish_reason == "error":  # the stream still ends as streams do
                error = out.error or "engine error"
                kind = "invalid_request_error" if failed_by_constraint(error) else "server_error"
                yield _event(error_body(error, kind))
                yield b"data: [DONE]\n\n"
                return
            # One event per token, even when its text is held back (a partial UTF-8 character, a
            # possible stop string): clients time tokens by events, so TBT stays measurable.
            fmt = choices.formatters[i]
            echoed = choices._echoed(choices.reqs[i], fmt) if first[i] else None  # before its first text
            logprobs = fmt.format(out.logprobs or []) if fmt is not None else None
            text, finish, calls = out.text, out.finish_reason, None
            if echoed:
                text, logprobs = echoed[0] + text, _joined(echoed[1], logprobs) if logprobs else logprobs
            if isinstance(choices.tools, ForcedCall) and choices.tools.name is not None:
                text, calls = "", _arguments_delta(choices.tools.name, out.text, first[i])
                finish = finish and (choices.tools.finish_reason if finish == "stop" else finish)
            elif choices.tools is not None:
                text, finish, calls = tool_delta(choices, i, shown, finish)
            chunk = completion_chunk(rid, model, text, finish, chat, first[i], logprobs, index=i, tool_calls=calls,
                                     reasoning=reasoning)
            if first[i]:  # vLLM's prompt_logprobs come with a choice's first chunk
                chunk = choices.with_prompt_logprobs(chunk, chat, i)
            if options.include_usage and options.continuous_usage_stats:  # vLLM's: both asked for
                chunk["usage"] = choices.usage(sent)  # as of this chunk
            yield _event(chunk)
            first[i] = False
        if options.include_usage:
            yield _event(completion_chunk(rid, model, "", None, chat) | {"choices": [], "usage": choices.usage(sent)})
        yield b"data: [DONE]\n\n"
    finally:
        choices.cancel_unfinished()  # client went away mid-stream, or a choice failed


def tool_delta(choices: Choices, i: int, shown: list[int], finish: str | None
                ) -> tuple[str, str | None, list[dict[str, Any]] | None]:
    """Choice i's next content delta when tools are offered: its text up to where a tool call may be
    starting; at its end, the rest, or the tool calls it made (finish_reason "tool_calls")."""
    parser, text = choices.tools, "".join(choices.texts[i])
    assert parser is not None
    if finish is not None:
        _, calls = parser.parse(text)
        if calls:  # the content before the calls, less the whitespace that separates them
            rest = text[shown[i]:max(shown[i], len(text[:parser.start(text)].rstrip()))]
            shown[i] = len(text)
            return rest, parser.finish_reason if finish == "stop" else finish, calls
        rest, shown[i] = text[shown[i]:], len(text)
        return rest, finish, None
    at = parser.start(text)
    safe = len(text[:at if at >= 0 else len(text) - parser.undecided(text)].rstrip())  # whitespace waits too
    delta = text[shown[i]:safe] if safe > shown[i] else ""
    shown[i] = max(shown[i], safe)
    return delta, None, None


def _joined(first: dict[str, Any] | None, then: dict[str, Any]) -> dict[str, Any]:
    """Completions' logprobs of the echoed prompt, then of the completion."""
    return then if first is None else {k: first[k] + then[k] for k in then}


def _arguments_delta(name: str, text: str, first: bool) -> list[dict[str, Any]] | None:
    """A named forced call streamed as OpenAI streams calls: the call (id, name) with the first piece
    of its arguments, then the arguments as they are written (the answer is the arguments object)."""
    if first:
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": text}}]
    return [{"function": {"arguments": text}}] if text else None


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
