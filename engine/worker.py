"""The engine worker's HTTP server: OpenAI-compatible endpoints over one Engine, plus /health,
/load and /metrics. SLO metadata comes in headers (set by the gateway, or by a client directly)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from jinja2 import TemplateError
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.params import FromPath
from litestar.response import Stream
from opentelemetry.trace import INVALID_SPAN

from engine import handoff
from engine.engine import Engine
from engine.openai_api import (
    CACHED_TOKENS_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    Unsupported,
    completion_body,
    error_body,
    http_error_body,
    new_id,
)
from engine.reasoning import CLOSE, OPEN, ReasoningParser, ReasoningStream
from engine.request import Request as EngineRequest
from engine.request import Sampled, TokenOutput
from engine.responses import Choices, LogprobFormatter, sse
from engine.slo import DEFAULT_CLASS, DEFAULT_CLASSES, SLOClass, shed_reason
from engine.structured_output import Grammars, failed_by_constraint
from engine.tool_calls import ForcedCall, ToolCallParser
from telemetry.metrics import EngineMetrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

DEFAULT_MAX_TOKENS = 16  # completions without max_tokens: OpenAI's legacy default
CHAT_DEFAULT_MAX_TOKENS = 1024  # chat without max_tokens: to the answer's end, up to this


def chat_default_max_tokens(prompt_tokens: int, room_tokens: int) -> int:
    """Without max_tokens a chat answer runs to its end, as OpenAI's do, within what the context and
    the worker's KV cache hold (`room_tokens`). The cap bounds an answer that never ends (a model
    that never says end-of-sequence, such as the embedded one); with kv_reservation "full" it is
    also reserved in KV when the batch forms. A client wanting longer answers says so. A prompt that
    leaves no room gets 1, which validation then refuses, naming the context."""
    return max(1, min(CHAT_DEFAULT_MAX_TOKENS, room_tokens - prompt_tokens))
MAX_CHOICES = 128  # n: OpenAI's limit
HANDOFF_TIMEOUT_S = 30.0  # a decode request waits this long for its prefill worker's KV


class EventStream(Stream):
    """Server-sent events that say so: Litestar gives a handler's default media type (JSON, for the
    handlers that also answer JSON) precedence over the response's own, and a strict SSE client
    refuses a stream sent as application/json."""

    def to_asgi_response(self, *args: Any, media_type: Any = None, **kwargs: Any) -> Any:
        return super().to_asgi_response(*args, **kwargs)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _error(_: Request, exc: BadRequest) -> Response:
    code = exc.code or ("model_not_found" if exc.status == 404 else None)
    return Response(error_body(str(exc), param=exc.param, code=code), status_code=exc.status)


ROLES = ("colocated", "prefill", "decode")


def create_worker_app(engine: Engine, model_name: str, classes: dict[str, SLOClass] | None = None,
                      default_class: str = DEFAULT_CLASS, tracing: TracerProvider | None = None,
                      role: str = "colocated", tool_call_parser: str | None = None,
                      reasoning_parser: str | None = None) -> Litestar:
    """`tracing`: a configured provider (telemetry.tracing.setup_tracing) turns on request and
    preemption spans; without one, no tracing code runs. `role`: colocated (prefill and decode),
    prefill (only the prefill half of disaggregated requests, handing the KV on) or decode (only
    requests whose KV is handed to it)."""
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
    tool_parser = ToolCallParser(tool_call_parser) if tool_call_parser else None
    reasoner = ReasoningParser(reasoning_parser) if reasoning_parser else None
    grammars = Grammars(engine.tokenizer, engine.model.cfg.vocab_size)
    classes = classes or DEFAULT_CLASSES
    metrics = EngineMetrics(engine, model_name)
    tracer = None
    if tracing is not None:
        from telemetry.tracing import EngineTracer
        tracer = EngineTracer(engine, model_name)
    inbox = handoff.KVInbox()
    peers = httpx.AsyncClient(timeout=httpx.Timeout(HANDOFF_TIMEOUT_S, connect=2.0))

    def transfer_span(name: str, **attrs: Any) -> Any:
        """A span around a KV transfer (a no-op span without tracing: attributes can still be set)."""
        return tracer.span(name, attrs) if tracer is not None else contextlib.nullcontext(INVALID_SPAN)

    def slo_for(request: Request, body: Any) -> SLOClass:
        name = request.headers.get("x-slo-class") or body.service_tier or default_class
        if name not in classes:
            if request.headers.get("x-slo-class"):
                raise BadRequest(f"unknown SLO class {name!r}; known: {sorted(classes)}", param="x-slo-class")
            name = default_class  # OpenAI's own service_tier values ("auto", "default", ...)
        slo = classes[name]
        if ttft := request.headers.get("x-slo-ttft-ms"):
            try:
                slo = msgspec.structs.replace(slo, ttft_ms=float(ttft))
            except ValueError:
                raise BadRequest("x-slo-ttft-ms must be a number", param="x-slo-ttft-ms") from None
        return slo

    async def run(request: Request, chat: bool) -> Any:
        raw = await request.body()
        try:
            body = msgspec.json.decode(raw, type=ChatCompletionRequest if chat else CompletionRequest)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid request body: {exc}") from None
        except msgspec.DecodeError:
            raise BadRequest("request body is not valid JSON") from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        if body.model and body.model != model_name:
            raise BadRequest(f"model {body.model!r} does not exist; this worker serves {model_name!r}",
                             status=404, param="model")
        tools = None  # offered to the model, its calls read back by `calls`
        calls: ToolCallParser | ForcedCall | None = None
        prompt = None  # a chat request's, as its template wrote it
        echo = None  # completions' echo: each prompt's text given back
        try:
            if chat:
                if (field := body.unsupported(tool_parser is not None)) is not None:
                    raise Unsupported(field)
                if not body.messages:
                    raise ValueError("messages must not be empty")
                if body.tools_wanted():
                    tools, calls = body.tools, ForcedCall(body.tools, body.tool_choice, body.parallel_tool_calls
                                                          is not False) if body.forces_tool_call() else tool_parser
                elif body.forces_tool_call():
                    raise ValueError("tool_choice asks for a tool call, but no tools are given")
                try:
                    prompt = engine.tokenizer.apply_chat_template([m.for_template() for m in body.messages], tools,
                                                                  **body.template_kwargs())
                except (TemplateError, TypeError) as exc:  # what the messages gave the template it cannot use
                    raise ValueError(f"the chat template cannot render these messages: {exc}") from None
                ids = engine.tokenizer.encode(prompt)
                prompts = [(ids, prompt)]
                room = min(engine.model.cfg.max_position_embeddings, engine.kv.num_blocks * engine.kv.block_size)
                sampling = body.sampling(chat_default_max_tokens(len(ids), room), tool_calls=tool_parser is not None,
                                         guide=calls.guide if isinstance(calls, ForcedCall) else None)
            else:
                sampling = body.sampling(DEFAULT_MAX_TOKENS)
                prompts = body.prompts(engine.tokenizer.encode)
                ids = prompts[0][0]

        except Unsupported as exc:
            raise BadRequest(str(exc), param=exc.field, code="unsupported_parameter") from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        grammar = None  # structured output: compiled off the event loop (a large schema takes a while),
        # and before the request id is made unique: nothing may wait between that and adding it
        if sampling.guide is not None:
            try:
                grammar = await asyncio.to_thread(grammars.matcher, sampling.guide)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        slo = slo_for(request, body)
        rid = request.headers.get("x-request-id") or new_id("chatcmpl" if chat else "cmpl")
        kv_to, kv_id = request.headers.get(handoff.KV_TO_HEADER), request.headers.get(handoff.KV_ID_HEADER)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n must be in [1, {MAX_CHOICES}]", param="n")
        total = n * len(prompts)  # engine requests: n choices of each prompt
        if not (kv_to or kv_id) and any(engine.has_request(i) for i in _choice_ids(rid, total)):
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # a client's id reused while its first runs (a hand-off's
            # id is the gateway's, unique, and its KV's key)
        # A misrouted request is refused before any work, so the router can send it where it belongs.
        if role == "prefill" and not kv_to:
            raise BadRequest(f"this worker only prefills: send it requests with {handoff.KV_TO_HEADER}", status=421)
        if role == "decode" and not kv_id:
            raise BadRequest(f"this worker only decodes: send it requests with {handoff.KV_ID_HEADER}", status=421)
        if total > 1 and (kv_to or kv_id):
            raise BadRequest("n > 1 and batched prompts are not supported with prefill/decode disaggregation",
                             param="n" if n > 1 else "prompt")
        if (sampling.prompt_logprobs is not None or not sampling.max_tokens) and (kv_to or kv_id):
            raise BadRequest("prompt logprobs (echo with logprobs, prompt_logprobs) and max_tokens 0 are not "
                             "supported with prefill/decode disaggregation",  # the prefill worker's to give
                             param="prompt_logprobs" if body.prompt_logprobs is not None else "echo")
        if kv_to:  # the prefill half of a disaggregated request: the first token, then hand the KV over
            if body.stream:
                raise BadRequest(f"a request with {handoff.KV_TO_HEADER} must not stream")
            sampling = msgspec.structs.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
        # n choices of each prompt are n engine requests: choice i's seed is seed + i (reproducible,
        # yet different; a prompt of a batch samples as it would alone)
        seeds = [None if sampling.seed is None else (sampling.seed + i) % 2**64 for i in range(n)]
        reqs = [EngineRequest.for_class(slo, request_id=cid, prompt_token_ids=prompts[k // n][0], choice=k % n,
                                        sampling=msgspec.structs.replace(sampling, seed=seeds[k % n]) if k % n
                                        else sampling, export_kv=bool(kv_to))
                for k, cid in enumerate(_choice_ids(rid, total))]
        req = reqs[0]
        thinking = reasoner is not None and prompt is not None and reasoner.starts_thinking(prompt)
        if grammar is not None and reasoner is not None and prompt is not None:
            # the structured output applies to what follows the reasoning; an answer that may open
            # reasoning decides at its first token (with a single token that opens it to choose)
            opener = engine.tokenizer.encode(OPEN) if reasoner.may_open(prompt) else []
            for r in reqs:
                r.thinking_until = CLOSE if thinking else None
                r.opens_thinking = opener if len(opener) == 1 else []
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        for r in reqs:
            r.sink = lambda out: loop.call_soon_threadsafe(queue.put_nowait, out)
        headers = {"x-slo-class": slo.name, "x-request-id": rid}
        if total > engine.cfg.max_waiting:  # never admissible here: not a 503 to retry
            raise BadRequest(f"{total} completions (n x prompts) exceed this worker's queue bound of "
                             f"{engine.cfg.max_waiting}", param="n" if n > 1 else "prompt")
        try:
            for r in reqs[::n]:  # each prompt
                engine.validate(r)
            if not chat and body.echo:  # each prompt's text as given, or its (valid) token ids' text
                echo = [text if text is not None else engine.tokenizer.decode(p) for p, text in prompts]
            for r in reqs:
                r.grammar = grammar and grammar.deep_copy()
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if kv_id:  # the decode half: admitted at prefill; its KV comes from the prefill worker
            with transfer_span("kv_transfer", **{"flowprefill.direction": "in", "flowprefill.request_id": kv_id}):
                try:
                    wait_s = min(HANDOFF_TIMEOUT_S, float(request.headers.get("x-flowprefill-handoff-timeout-s")
                                                          or HANDOFF_TIMEOUT_S))
                except ValueError:
                    raise BadRequest("x-flowprefill-handoff-timeout-s must be a number") from None
                try:
                    kv, first = await inbox.take(kv_id, wait_s)
                except TimeoutError:
                    raise BadRequest(f"no KV was handed off for {kv_id!r}", status=504) from None
            cached = request.headers.get(CACHED_TOKENS_HEADER, "0")  # what the prefill worker found cached
            if cached.isascii() and cached.isdecimal():
                req.cached_tokens = min(int(cached), req.num_prompt_tokens)
            if tracer is not None:
                tracer.start(req, "chat" if chat else "text_completion", handed_off=True)
            try:
                engine.add_prefilled(req, kv, first)
            except ValueError as exc:
                if tracer is not None:
                    req.finish_reason = "error"
                    tracer.on_finish(req)
                raise BadRequest(str(exc)) from None
        elif reason := engine.admission(reqs, slo.sheddable):
            status = 429 if reason == "predicted_slo_miss" else 503
            message = ("the request cannot meet its TTFT target here (predicted); retry later or with a looser class"
                       if status == 429 else "the worker's queue is full")
            return Response(error_body(message, "rate_limit_exceeded" if status == 429 else "server_error",
                                       code=reason), status_code=status,
                            headers=headers | {"retry-after": "1", "x-flowprefill-dropped-reason": reason})
        else:
            for added, r in enumerate(reqs):
                if tracer is not None:
                    tracer.start(r, "chat" if chat else "text_completion")
                try:
                    engine.add_request(r)
                except ValueError as exc:
                    if tracer is not None:  # never queued: the engine will not close its span
                        r.finish_reason = "error"
                        tracer.on_finish(r)
                    for queued in reqs[:added]:  # choices already queued go too
                        engine.cancel(queued.request_id)
                    raise BadRequest(str(exc)) from None
        if req.predicted_miss:  # served anyway, after feasible requests; a gateway may shed instead
            headers["x-flowprefill-predicted-miss"] = "true"
        model = model_name
        choices = Choices(engine, reqs, queue, None if sampling.logprobs is None
                          else lambda: LogprobFormatter(engine.tokenizer.token_bytes, chat),
                          calls, (lambda: ReasoningStream(reasoner, thinking)) if reasoner and prompt is not None
                          else None, echo, body.prompt_logprobs)
        if body.stream:
            options = body.stream_options or StreamOptions()
            return EventStream(sse(choices, rid, model, chat, options), media_type="text/event-stream",
                               headers=headers)
        await choices.gather()
        if reason := shed_reason(choices.error):  # turned hopeless while queued (a late = "shed" class)
            return Response(error_body(choices.error or "", "rate_limit_exceeded", code=reason), status_code=429,
                            headers=headers | {"retry-after": "1", "x-flowprefill-dropped-reason": reason})
        if choices.error is not None:
            client = failed_by_constraint(choices.error)
            return Response(error_body(choices.error, "invalid_request_error" if client else "server_error"),
                            status_code=400 if client else 500, headers=headers)
        if kv_to and req.kv_export is not None:
            kv, req.kv_export = req.kv_export, None
            transport = "http" if request.headers.get(handoff.TRANSPORT_HEADER) == "http" else "auto"
            t0 = time.perf_counter()
            try:
                with transfer_span("kv_transfer", **{"flowprefill.direction": "out", "flowprefill.request_id": rid,
                                                     "server.address": kv_to}) as span:
                    logprobs = choices.logprobs[0]
                    first = Sampled(req.output_token_ids[0], logprobs[0] if logprobs else None)
                    used, size = await handoff.send(peers, kv_to, rid, kv, first, transport)
                    span.set_attributes({"flowprefill.kv_bytes": size, "flowprefill.kv_transport": used})
            except (httpx.HTTPError, OSError) as exc:
                return Response(error_body(f"handing the KV to {kv_to} failed: {exc}", "server_error"),
                                status_code=502, headers=headers)
            headers |= {"x-flowprefill-kv-bytes": str(size), "x-flowprefill-kv-transport": used,
                        CACHED_TOKENS_HEADER: str(req.cached_tokens),
                        "x-flowprefill-kv-ms": f"{(time.perf_counter() - t0) * 1000:.3f}"}
        return Response(choices.with_prompt_logprobs(completion_body(rid, model, choices.bodies(), chat,
                                                                     choices.usage()), chat), headers=headers)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        return await run(request, chat=False)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        return await run(request, chat=True)

    @post("/v1/internal/kv/{request_id:str}", status_code=204, request_max_body_size=4 * 1024**3)
    async def receive_kv(request: Request, request_id: FromPath[str]) -> None:
        shm = request.headers.get(handoff.SHM_HEADER)
        try:
            got = handoff.read_shm(shm) if shm else handoff.unpack(await request.body())
        except Exception as exc:
            raise BadRequest(f"handed-off KV is not readable: {exc}") from None
        if got is None:  # not on this host's /dev/shm after all: the sender falls back to HTTP
            raise BadRequest(f"{shm} is not visible to this worker", status=404, code=handoff.SHM_MISSING)
        inbox.put(request_id, *got)

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        # max_model_len as vLLM's: clients size prompts by it
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "flowprefill",
                                            "max_model_len": engine.model.cfg.max_position_embeddings}]}

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "role": role}

    @get("/load")
    async def load() -> dict[str, Any]:
        s = engine.scheduler
        backlog: dict[str, float] = {}
        for r in list(s.waiting):
            backlog[r.slo_class] = backlog.get(r.slo_class, 0.0) + s.predict_s(r)
        return {"role": role, "waiting": engine.num_waiting, "decoding": engine.num_decoding,
                "suspended_batches": max(0, len(s.pool) - 1),
                "predicted_backlog_s": sum(b.remaining_s for b in list(s.pool)) + sum(backlog.values()),
                "predicted_backlog_by_class_s": backlog, "kv_cache_usage": engine.kv.usage}

    @get("/metrics", media_type="text/plain; version=0.0.4")
    async def prometheus() -> bytes:
        return metrics.render()

    plugins = []
    if tracing is not None:
        from telemetry.tracing import litestar_plugin
        plugins.append(litestar_plugin(exclude=["/health", "/load", "/metrics"]))
    return Litestar(
        route_handlers=[completions, chat_completions, receive_kv, models, health, load, prometheus],
        exception_handlers={BadRequest: _error, HTTPException: _http_error},
        on_startup=[grammars.warm_up],
        on_shutdown=[engine.shutdown, peers.aclose] + ([tracing.shutdown] if tracing is not None else []),
        request_max_body_size=16 * 1024 * 1024,
        plugins=plugins,
    )


def _choice_ids(rid: str, n: int) -> list[str]:
    """The engine request ids of a request's n choices: its own id for the first."""
    return [rid, *(f"{rid}-{i}" for i in range(1, n))]


def _http_error(_: Request, exc: HTTPException) -> Response:
    return Response(http_error_body(exc.status_code, exc.detail), status_code=exc.status_code,
                    headers=exc.headers or None)
