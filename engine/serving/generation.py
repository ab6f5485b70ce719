"""The generation path every generating endpoint shares (completions, chat completions, the Responses
API): a decoded request body becomes engine requests (the chat template, sampling, structured
output, the SLO class from the headers, admission, the KV hand-off of disaggregated serving), and
their outputs one `Choices` that each endpoint formats its own way."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from jinja2 import TemplateError
from litestar import Request, Response
from litestar.response import Stream
from opentelemetry.trace import INVALID_SPAN

from engine.core.engine import ENGINE_STOPPED, Engine
from engine.core.request import Request as EngineRequest
from engine.core.request import Sampled, SamplingParams, TokenOutput
from engine.protocol.drain import SHUTTING_DOWN, ClientGone, Drain, ShuttingDown
from engine.protocol.headers import (
    CACHED_TOKENS_HEADER,
    DROPPED_REASON_HEADER,
    HANDOFF_TIMEOUT_HEADER,
    KV_BYTES_HEADER,
    KV_ID_HEADER,
    KV_MS_HEADER,
    KV_TO_HEADER,
    KV_TRANSPORT_HEADER,
    PREDICTED_MISS_HEADER,
    REQUEST_ID_HEADER,
    SLO_CLASS_HEADER,
)
from engine.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    Unsupported,
    error_body,
    new_id,
)
from engine.protocol.slo import SHED_REASON, SLOClass, requested_slo, shed_reason
from engine.protocol.worker import LOAD_REPORT_HEADER, load_report
from engine.serving import kv_transport
from engine.serving.choices import Choices, LogprobFormatter, completion_body, sse
from engine.serving.endpoint import BadRequest, EventStream, decode_body
from engine.serving.reasoning import CLOSE, OPEN, ReasoningParser, ReasoningStream
from engine.serving.stages import HeldKV, Prepared, Started
from engine.serving.structured_output import Grammars, GuidedAnswer, failed_by_constraint
from engine.serving.tool_calls import ForcedCall, ToolCallParser

if TYPE_CHECKING:
    from telemetry.tracing import EngineTracer

DEFAULT_MAX_TOKENS = 16  # completions without max_tokens: OpenAI's legacy default
CHAT_DEFAULT_MAX_TOKENS = 1024  # chat without max_tokens: to the answer's end, up to this
MAX_CHOICES = 128  # n: OpenAI's limit
HANDOFF_TIMEOUT_S = 30.0  # a decode request waits this long for its prefill worker's KV


def chat_default_max_tokens(prompt_tokens: int, room_tokens: int) -> int:
    """Without max_tokens a chat answer runs to its end, as OpenAI's do, within what the context and
    the worker's KV cache hold (`room_tokens`). The cap bounds an answer that never ends (a model
    that never says end-of-sequence, such as the embedded one); with kv_reservation "full" it is
    also reserved in KV when the batch forms. A client wanting longer answers says so. A prompt that
    leaves no room gets 1, which validation then refuses, naming the context."""
    return max(1, min(CHAT_DEFAULT_MAX_TOKENS, room_tokens - prompt_tokens))


class Generation:
    """The worker's generating requests, whatever endpoint they came by."""

    def __init__(self, engine: Engine, model_name: str, classes: dict[str, SLOClass], default_class: str,
                 tracer: EngineTracer | None, role: str, tool_parser: ToolCallParser | None,
                 reasoner: ReasoningParser | None, drain: Drain | None = None) -> None:
        self.engine, self.model, self.classes, self.default_class = engine, model_name, classes, default_class
        self.drain = drain or Drain()
        self.tracer, self.role, self.tool_parser, self.reasoner = tracer, role, tool_parser, reasoner
        self.grammars = Grammars(engine.tokenizer, engine.model.cfg.vocab_size)
        self.inbox = kv_transport.KVInbox()
        self.peers = httpx.AsyncClient(timeout=httpx.Timeout(HANDOFF_TIMEOUT_S, connect=2.0))

    def check_model(self, model: str | None) -> None:
        if model and model != self.model:
            raise BadRequest(f"model {model!r} does not exist; this worker serves {self.model!r}",
                             status=404, param="model")

    def transfer_span(self, name: str, **attrs: Any) -> Any:
        """A span around a KV transfer (a no-op span without tracing: attributes can still be set)."""
        return self.tracer.span(name, attrs) if self.tracer is not None else contextlib.nullcontext(INVALID_SPAN)

    async def completion(self, request: Request, chat: bool) -> Response | Stream:
        """POST /v1/completions and /v1/chat/completions."""
        body = decode_body(await request.body(), ChatCompletionRequest if chat else CompletionRequest)
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        started = await self.start(request, body, chat)
        if isinstance(started, Response):
            return started
        choices, rid, headers = started.choices, started.rid, started.headers
        if body.stream:
            return EventStream(sse(choices, rid, self.model, chat, body.stream_options or StreamOptions()),
                               media_type="text/event-stream", headers=headers)
        if (failed := await self.finish(request, started)) is not None:
            return failed
        return Response(choices.with_prompt_logprobs(completion_body(rid, self.model, choices.bodies(), chat,
                                                                     choices.usage()), chat), headers=headers)

    def prepare(self, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Prepared:
        """The prompts and sampling of a request: a chat request's messages through the template."""
        engine = self.engine
        try:
            if not chat:
                return Prepared(body.prompts(engine.tokenizer.encode), body.sampling(DEFAULT_MAX_TOKENS))
            assert isinstance(body, ChatCompletionRequest)
            if (field := body.unsupported(self.tool_parser is not None)) is not None:
                raise Unsupported(field)
            if not body.messages:
                raise ValueError("messages must not be empty")
            tools, calls = None, None  # offered to the model, its calls read back by `calls`
            if body.tools_wanted():
                tools, calls = body.tools, ForcedCall(body.tools, body.tool_choice, body.parallel_tool_calls
                                                      is not False) if body.forces_tool_call() else self.tool_parser
            elif body.forces_tool_call():
                raise ValueError("tool_choice asks for a tool call, but no tools are given")
            prompt = self.render(body.messages, tools, body.template_kwargs())
            ids = engine.tokenizer.encode(prompt)
            room = min(engine.model.cfg.max_position_embeddings, engine.kv.num_blocks * engine.kv.block_size)
            sampling = body.sampling(chat_default_max_tokens(len(ids), room), tool_calls=self.tool_parser is not None,
                                     guide=calls.guide if isinstance(calls, ForcedCall) else None)
            return Prepared([(ids, prompt)], sampling, calls, prompt)
        except Unsupported as exc:
            raise BadRequest(str(exc), param=exc.field, code="unsupported_parameter") from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def render(self, messages: list[ChatMessage], tools: list[Any] | None, kwargs: dict[str, Any],
               add_generation_prompt: bool = True) -> str:
        """Chat messages as the chat template writes them (ValueError for what it cannot render)."""
        try:
            return self.engine.tokenizer.apply_chat_template([m.for_template() for m in messages], tools,
                                                             add_generation_prompt, **kwargs)
        except (TemplateError, TypeError) as exc:  # what the messages gave the template it cannot use
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def slo_for(self, request: Request, body: Any) -> SLOClass:
        try:
            return requested_slo(request.headers, body.service_tier, self.classes, self.default_class)
        except ValueError as exc:
            raise BadRequest(str(exc), param=getattr(exc, "param", None)) from None

    async def start(self, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                    id_prefix: str | None = None) -> Started | Response:
        """The request's engine requests, admitted and queued (or its KV taken from the prefill
        worker); a Response when it is shed. `id_prefix`: the id's when the client gave none."""
        self.check_model(body.model)
        if self.drain.draining:  # a gateway retries it at another worker
            raise BadRequest("the worker is shutting down; retry the request", status=503, code=SHUTTING_DOWN)
        prep = self.prepare(body, chat)
        grammar = None  # structured output: compiled off the event loop (a large schema takes a while),
        # and before the request id is made unique: nothing may wait between that and adding it
        if prep.sampling.guide is not None:
            try:
                grammar = await asyncio.to_thread(self.grammars.matcher, prep.sampling.guide)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        slo = self.slo_for(request, body)
        kv_to, kv_id = request.headers.get(KV_TO_HEADER), request.headers.get(KV_ID_HEADER)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n must be in [1, {MAX_CHOICES}]", param="n")
        self._check_route(kv_to, kv_id, n, len(prep.prompts), prep.sampling, body)
        rid = self._request_id(request, id_prefix or ("chatcmpl" if chat else "cmpl"), n * len(prep.prompts),
                               bool(kv_to or kv_id))
        sampling = prep.sampling
        if kv_to:  # the prefill half of a disaggregated request: the first token, then hand the KV over
            if body.stream:
                raise BadRequest(f"a request with {KV_TO_HEADER} must not stream")
            sampling = msgspec.structs.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
        held = HeldKV() if kv_to else None
        reqs = self._engine_requests(slo, rid, n, prep, sampling, held)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        for r in reqs:
            r.sink = lambda out: loop.call_soon_threadsafe(queue.put_nowait, out)
        headers = {SLO_CLASS_HEADER: slo.name, REQUEST_ID_HEADER: rid}
        echo = self._validate(reqs, n, prep, not chat and bool(body.echo))
        thinking = self._constrain(reqs, prep.prompt, grammar)
        if kv_id:
            await self._receive_handoff(request, reqs[0], kv_id, "chat" if chat else "text_completion")
        elif (shed := await self._admit(reqs, slo, headers, "chat" if chat else "text_completion")) is not None:
            return shed
        if reqs[0].predicted_miss:  # served anyway, after feasible requests; a gateway may shed instead
            headers[PREDICTED_MISS_HEADER] = "true"
        if body.stream:  # its headers leave now, with this request in the report; a whole answer's in finish
            headers[LOAD_REPORT_HEADER] = load_report(self.engine.load())
        reasoner = self.reasoner
        choices = Choices(self.engine, reqs, queue, None if sampling.logprobs is None
                          else lambda: LogprobFormatter(self.engine.tokenizer.token_bytes, chat),
                          prep.calls, (lambda: ReasoningStream(reasoner, thinking))
                          if reasoner and prep.prompt is not None else None, echo, body.prompt_logprobs)
        return Started(rid, choices, headers, kv_to, held)

    def _check_route(self, kv_to: str | None, kv_id: str | None, n: int, prompts: int, sampling: SamplingParams,
                     body: Any) -> None:
        """A misrouted request is refused before any work, so the router can send it where it belongs."""
        if self.role == "prefill" and not kv_to:
            raise BadRequest(f"this worker only prefills: send it requests with {KV_TO_HEADER}", status=421)
        if self.role == "decode" and not kv_id:
            raise BadRequest(f"this worker only decodes: send it requests with {KV_ID_HEADER}", status=421)
        if n * prompts > 1 and (kv_to or kv_id):
            raise BadRequest("n > 1 and batched prompts are not supported with prefill/decode disaggregation",
                             param="n" if n > 1 else "prompt")
        if (sampling.prompt_logprobs is not None or not sampling.max_tokens) and (kv_to or kv_id):
            raise BadRequest("prompt logprobs (echo with logprobs, prompt_logprobs) and max_tokens 0 are not "
                             "supported with prefill/decode disaggregation",  # the prefill worker's to give
                             param="prompt_logprobs" if body.prompt_logprobs is not None else "echo")

    def _request_id(self, request: Request, prefix: str, total: int, handed_off: bool) -> str:
        rid = request.headers.get(REQUEST_ID_HEADER) or new_id(prefix)
        if not handed_off and any(self.engine.has_request(i) for i in _choice_ids(rid, total)):
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # a client's id reused while its first runs (a hand-off's
            # id is the gateway's, unique, and its KV's key)
        return rid

    def _engine_requests(self, slo: SLOClass, rid: str, n: int, prep: Prepared, sampling: SamplingParams,
                         held: HeldKV | None) -> list[EngineRequest]:
        """n choices of each prompt are n engine requests: choice i's seed is seed + i (reproducible,
        yet different; a prompt of a batch samples as it would alone). `held`: the prefill half's (one
        request) KV, given to it on the engine thread before the first token's output is queued."""
        seeds = [None if sampling.seed is None else (sampling.seed + i) % 2**64 for i in range(n)]
        keep = None if held is None else lambda kv: setattr(held, "kv", kv)
        return [EngineRequest.for_class(
            slo, request_id=cid, prompt_token_ids=prep.prompts[k // n][0], choice=k % n, kv_sink=keep,
            sampling=msgspec.structs.replace(sampling, seed=seeds[k % n]) if k % n else sampling)
            for k, cid in enumerate(_choice_ids(rid, n * len(prep.prompts)))]

    def _constrain(self, reqs: list[EngineRequest], prompt: str | None, grammar: Any) -> bool:
        """Whether the answers begin in reasoning; with a structured output, each answer's own
        GuidedAnswer, which applies to what follows the reasoning (an answer that may open reasoning
        decides at its first token, with a single token that opens it to choose)."""
        reasoner = self.reasoner
        thinking = reasoner is not None and prompt is not None and reasoner.starts_thinking(prompt)
        if grammar is not None:
            opener = (self.engine.tokenizer.encode(OPEN) if reasoner is not None and prompt is not None
                      and reasoner.may_open(prompt) else [])
            for r in reqs:
                r.constraint = GuidedAnswer(grammar.deep_copy(), CLOSE if thinking else None,
                                            opener if len(opener) == 1 else [], CLOSE)
        return thinking

    def _validate(self, reqs: list[EngineRequest], n: int, prep: Prepared, echo: bool) -> list[str] | None:
        """Each prompt checked against this worker's limits; completions' echoed prompt texts."""
        if len(reqs) > self.engine.cfg.max_waiting:  # never admissible here: not a 503 to retry
            raise BadRequest(f"{len(reqs)} completions (n x prompts) exceed this worker's queue bound of "
                             f"{self.engine.cfg.max_waiting}", param="n" if n > 1 else "prompt")
        try:
            for r in reqs[::n]:  # each prompt
                self.engine.validate(r)
            echoed = None  # each prompt's text as given, or its (valid) token ids' text
            if echo:
                echoed = [text if text is not None else self.engine.tokenizer.decode(p) for p, text in prep.prompts]
            return echoed
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def _receive_handoff(self, request: Request, req: EngineRequest, kv_id: str, operation: str) -> None:
        """The decode half: admitted at prefill; its KV comes from the prefill worker."""
        with self.transfer_span("kv_transfer", **{"flowprefill.direction": "in", "flowprefill.request_id": kv_id}):
            try:
                wait_s = min(HANDOFF_TIMEOUT_S, float(request.headers.get(HANDOFF_TIMEOUT_HEADER)
                                                      or HANDOFF_TIMEOUT_S))
            except ValueError:
                raise BadRequest(f"{HANDOFF_TIMEOUT_HEADER} must be a number") from None
            try:
                kv, first = await self.inbox.take(kv_id, wait_s)
            except TimeoutError:
                raise BadRequest(f"no KV was handed off for {kv_id!r}", status=504) from None
        cached = request.headers.get(CACHED_TOKENS_HEADER, "0")  # what the prefill worker found cached
        if cached.isascii() and cached.isdecimal():
            req.cached_tokens = min(int(cached), req.num_prompt_tokens)
        if self.tracer is not None:
            self.tracer.start(req, operation, handed_off=True)
        try:
            self.engine.add_prefilled(req, kv, first)
        except ValueError as exc:
            if self.tracer is not None:
                req.finish_reason = "error"
                self.tracer.on_finish(req)
            raise BadRequest(str(exc)) from None

    async def _admit(self, reqs: list[EngineRequest], slo: SLOClass, headers: dict[str, str],
                     operation: str) -> Response | None:
        """Queues the engine requests; the answer when they are shed instead (the engine decides, on its
        own thread, with its queue as it is then: engine/core/messages.py)."""
        on_queued = None
        if (tracer := self.tracer) is not None:  # their spans open as they queue, children of this HTTP span
            ctx = contextvars.copy_context()
            on_queued = lambda: [ctx.run(tracer.start, r, operation) for r in reqs]  # noqa: E731
        try:
            verdict = self.engine.submit(reqs, slo.sheddable, on_queued)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        except RuntimeError:  # the engine stopped (the worker's shutdown deadline passed)
            return shutting_down(headers, "worker")
        if refusal := await asyncio.wrap_future(verdict):
            return _shed(refusal.message, refusal.reason, 429 if refusal.reason == SHED_REASON else 503, headers)
        return None

    async def finish(self, request: Request, started: Started) -> Response | None:
        """Waits for every choice of a request answered whole; the error answer when one failed. The
        prefill half of a disaggregated request then hands its KV on (its headers say how)."""
        choices, headers = started.choices, started.headers
        try:  # a client that leaves, or a shutdown's deadline, cancels every choice (gather's clean-up)
            await self.drain.guard(request.receive, choices.gather())
        except ClientGone:
            return Response(error_body("the client disconnected", "invalid_request_error", code="client_gone"),
                            status_code=499, headers=headers)  # nginx's "client closed request": never sent
        except ShuttingDown:
            return shutting_down(headers, "worker")
        # Its load report as the answer leaves, not as it was admitted: that one counted this request's
        # own prefill, done by now, and ranked this worker that much busier at the gateway until its next
        # poll, so a conversation's next turn could go to a worker without its history. A streamed
        # answer's headers leave once it is admitted, prefill to come.
        headers[LOAD_REPORT_HEADER] = load_report(self.engine.load())
        if reason := shed_reason(choices.error):  # turned hopeless while queued (a late = "shed" class)
            return _shed(choices.error or "", reason, 429, headers)
        if choices.error == ENGINE_STOPPED:
            return shutting_down(headers, "worker")
        if choices.error is not None:
            client = failed_by_constraint(choices.error)
            return Response(error_body(choices.error, "invalid_request_error" if client else "server_error"),
                            status_code=400 if client else 500, headers=headers)
        req, held = started.first, started.held
        if not started.kv_to or held is None or held.kv is None:
            return None
        kv, held.kv = held.kv, None
        transport = "http" if request.headers.get(KV_TRANSPORT_HEADER) == "http" else "auto"
        t0 = time.perf_counter()
        try:
            with self.transfer_span("kv_transfer", **{"flowprefill.direction": "out", "server.address": started.kv_to,
                                                      "flowprefill.request_id": started.rid}) as span:
                logprobs = choices.logprobs[0]
                first = Sampled(req.output_token_ids[0], logprobs[0] if logprobs else None)
                used, size = await kv_transport.send(self.peers, started.kv_to, started.rid, kv, first, transport)
                span.set_attributes({"flowprefill.kv_bytes": size, "flowprefill.kv_transport": used})
        except (httpx.HTTPError, OSError) as exc:
            return Response(error_body(f"handing the KV to {started.kv_to} failed: {exc}", "server_error"),
                            status_code=502, headers=headers)
        headers |= {KV_BYTES_HEADER: str(size), KV_TRANSPORT_HEADER: used,
                    CACHED_TOKENS_HEADER: str(req.cached_tokens),
                    KV_MS_HEADER: f"{(time.perf_counter() - t0) * 1000:.3f}"}
        return None


def _choice_ids(rid: str, n: int) -> list[str]:
    """The engine request ids of a request's n choices: its own id for the first."""
    return [rid, *(f"{rid}-{i}" for i in range(1, n))]


def shutting_down(headers: dict[str, str], what: str) -> Response:
    """The answer to a request still in flight when its server's grace period ran out: 503, to retry."""
    return Response(error_body(f"the {what} is shutting down; retry the request", "server_error", code=SHUTTING_DOWN),
                    status_code=503, headers=headers | {"retry-after": "1"})


def _shed(message: str, reason: str, status: int, headers: dict[str, str]) -> Response:
    """A request refused (at admission, or while queued): 429 or 503, Retry-After and the reason."""
    kind = "rate_limit_exceeded" if status == 429 else "server_error"
    return Response(error_body(message, kind, code=reason), status_code=status,
                    headers=headers | {"retry-after": "1", DROPPED_REASON_HEADER: reason})
