"""The engine worker's HTTP server: OpenAI-compatible endpoints over one Engine, plus /health,
/load and /metrics. SLO metadata comes in headers (set by the gateway, or by a client directly).
Each endpoint's handler is a small class of its own (the generating ones share engine/serving/generation.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.params import FromPath

from engine.core import batch_log, handoff
from engine.core.engine import Engine
from engine.protocol.drain import Drain
from engine.protocol.headers import KV_SHM_HEADER
from engine.protocol.openai import error_body, http_error_body
from engine.protocol.slo import DEFAULT_CLASS, DEFAULT_CLASSES, SLOClass
from engine.protocol.worker import ROLES, WorkerLoad
from engine.serving import kv_transport
from engine.serving.endpoint import BadRequest
from engine.serving.generation import (  # noqa: F401 (the limits' names, also read from here)
    CHAT_DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    Generation,
    chat_default_max_tokens,
)
from engine.serving.reasoning import ReasoningParser
from engine.serving.responses_api import ResponsesEndpoint
from engine.serving.tokenize_api import TokenizeEndpoints
from engine.serving.tool_calls import ToolCallParser
from telemetry.metrics import EngineMetrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def _error(_: Request, exc: BadRequest) -> Response:
    code = exc.code or ("model_not_found" if exc.status == 404 else None)
    return Response(error_body(str(exc), param=exc.param, code=code), status_code=exc.status)


class ModelList:
    """GET /v1/models and /v1/models/{id}: the one model this worker serves."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        # max_model_len as vLLM's: clients size prompts by it
        self.card = {"id": model_name, "object": "model", "created": 0, "owned_by": "flowprefill",
                     "max_model_len": engine.model.cfg.max_position_embeddings}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card]}

    async def model(self, model_id: FromPath[str]) -> dict[str, Any]:
        model_id = model_id.lstrip("/")  # a path parameter: ids may hold slashes ("org/name")
        if model_id != self.card["id"]:
            raise BadRequest(f"the model {model_id!r} does not exist", status=404, param="model")
        return self.card

    def handlers(self) -> list[Any]:
        return [get("/v1/models")(self.models), get("/v1/models/{model_id:path}")(self.model)]


class Status:
    """GET /health (503 once shutting down: a gateway stops sending it requests), /load (what a gateway
    routes on: Engine.load, one snapshot) and /metrics."""

    def __init__(self, engine: Engine, role: str, metrics: EngineMetrics, drain: Drain) -> None:
        self.engine, self.role, self.metrics, self.drain = engine, role, metrics, drain

    async def health(self) -> Response[dict[str, str]]:
        if self.drain.draining:
            return Response({"status": "shutting down", "role": self.role}, status_code=503)
        return Response({"status": "ok", "role": self.role})

    async def load(self) -> WorkerLoad:
        return msgspec.structs.replace(self.engine.load(), role=self.role)

    async def prometheus(self) -> bytes:
        return self.metrics.render()

    def handlers(self) -> list[Any]:
        return [get("/health")(self.health), get("/load")(self.load),
                get("/metrics", media_type="text/plain; version=0.0.4")(self.prometheus)]


class HandoffInbox:
    """POST /v1/internal/kv/{request id}: a prefill worker's KV for a request this decode worker will
    get (engine/serving/kv_transport.py), by shared memory or in the body."""

    def __init__(self, inbox: kv_transport.KVInbox) -> None:
        self.inbox = inbox

    async def receive(self, request: Request, request_id: FromPath[str]) -> None:
        shm = request.headers.get(KV_SHM_HEADER)
        try:
            got = kv_transport.read_shm(shm) if shm else handoff.unpack(await request.body())
        except Exception as exc:
            raise BadRequest(f"handed-off KV is not readable: {exc}") from None
        if got is None:  # not on this host's /dev/shm after all: the sender falls back to HTTP
            raise BadRequest(f"{shm} is not visible to this worker", status=404, code=kv_transport.SHM_MISSING)
        self.inbox.put(request_id, *got)

    def handlers(self) -> list[Any]:
        return [post("/v1/internal/kv/{request_id:str}", status_code=204,
                     request_max_body_size=4 * 1024**3)(self.receive)]


def create_worker_app(engine: Engine, model_name: str, classes: dict[str, SLOClass] | None = None,
                      default_class: str = DEFAULT_CLASS, tracing: TracerProvider | None = None,
                      role: str = "colocated", tool_call_parser: str | None = None,
                      reasoning_parser: str | None = None, drain: Drain | None = None) -> Litestar:
    """`tracing`: a configured provider (telemetry.tracing.setup_tracing) turns on request and
    preemption spans; without one, no tracing code runs. `role`: colocated (prefill and decode),
    prefill (only the prefill half of disaggregated requests, handing the KV on) or decode (only
    requests whose KV is handed to it). `drain`: the server's graceful shutdown (gateway/cli/common.py
    begins it): at its deadline the engine stops, and every request still in it ends with an error."""
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
    metrics = EngineMetrics(engine, model_name)
    batch_log.attach(engine)  # only with $FLOWPREFILL_BATCH_LOG (a diagnostic: engine/core/batch_log.py)
    tracer = None
    if tracing is not None:
        from telemetry.tracing import EngineTracer
        tracer = EngineTracer(engine, model_name)
    drain = drain or Drain()
    drain.on_deadline.append(lambda: asyncio.get_running_loop().run_in_executor(None, engine.shutdown))
    generation = Generation(engine, model_name, classes or DEFAULT_CLASSES, default_class, tracer, role,
                            ToolCallParser(tool_call_parser) if tool_call_parser else None,
                            ReasoningParser(reasoning_parser) if reasoning_parser else None, drain)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        return await generation.completion(request, chat=False)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        return await generation.completion(request, chat=True)

    plugins = []
    if tracing is not None:
        from telemetry.tracing import litestar_plugin
        plugins.append(litestar_plugin(exclude=["/health", "/load", "/metrics"]))
    return Litestar(
        route_handlers=[completions, chat_completions, *Status(engine, role, metrics, drain).handlers(),
                        *HandoffInbox(generation.inbox).handlers(), *ModelList(engine, model_name).handlers(),
                        *TokenizeEndpoints(generation).handlers(), *ResponsesEndpoint(generation).handlers()],
        exception_handlers={BadRequest: _error, HTTPException: _http_error},
        on_startup=[generation.grammars.warm_up],
        on_shutdown=[engine.shutdown, generation.peers.aclose] + ([tracing.shutdown] if tracing is not None else []),
        request_max_body_size=16 * 1024 * 1024,
        plugins=plugins,
    )


def _http_error(_: Request, exc: HTTPException) -> Response:
    return Response(http_error_body(exc.status_code, exc.detail), status_code=exc.status_code,
                    headers=exc.headers or None)
