"""The Litestar SLO gateway: its routes and their wiring. The generating requests' path (classify, stamp
a deadline, route, forward, streaming or not) is gateway/forward.py's; the cheap ones, gateway/lookups.py."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Litestar, Request, Response, asgi, get
from litestar.datastructures import Headers
from litestar.exceptions import HTTPException, MethodNotAllowedException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import ASGIRouteHandler
from litestar.response import Stream
from litestar.types import Receive, Scope, Send  # at run time: Litestar reads the annotations

from engine.protocol.drain import SHUTTING_DOWN, ClientGone, Drain, ShuttingDown
from engine.protocol.headers import DROPPED_REASON_HEADER, SLO_CLASS_HEADER
from engine.protocol.openai import error_body, http_error_body
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, InternalErrors
from gateway.forward import RESPONSES, Forwarder, PrefillFirst, Upstreams
from gateway.lookups import Lookups
from gateway.openapi import openapi_document
from gateway.routing import WorkerPool
from telemetry.metrics import GatewayMetrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def create_gateway_app(cfg: GatewayConfig, tracing: TracerProvider | None = None, drain: Drain | None = None
                       ) -> Litestar:
    """`tracing`: a configured provider (telemetry.tracing.setup_tracing) turns on a server span per
    request, annotated with the SLO decision and the route, and W3C propagation to the workers.
    `drain`: the server's graceful shutdown (gateway/cli/common.py begins it): /health answers 503,
    and at its deadline the requests in flight end with a 503 or a stream's error event."""
    drain = drain or Drain()
    metrics = GatewayMetrics()
    annotate = _span_annotator() if tracing is not None else None
    upstreams = Upstreams(cfg)
    pool, prefill_pool = _pools(cfg, upstreams, metrics)
    authorize = _authorizer(cfg)
    forward = Forwarder(cfg, pool, PrefillFirst(prefill_pool, upstreams, metrics) if prefill_pool else None,
                        upstreams, metrics, authorize, annotate)
    document = openapi_document()

    def _error(_: Request, exc: GatewayError) -> Response:
        metrics.answered(exc.headers.get(SLO_CLASS_HEADER, "unclassified"), exc.status,
                         exc.headers.get(DROPPED_REASON_HEADER))
        return Response(error_body(str(exc), exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)

    @get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return document

    @get("/metrics", media_type="text/plain; version=0.0.4")
    async def prometheus() -> bytes:
        return metrics.render()

    on_startup, on_shutdown, plugins = _lifecycle([p for p in (pool, prefill_pool) if p is not None],
                                                  upstreams, tracing)
    lookups = Lookups(cfg, pool, upstreams.client, metrics, authorize, annotate)
    return Litestar(route_handlers=[*(_proxied(p, forward, cfg.max_body_bytes, drain) for p in GENERATING),
                                    *lookups.handlers(), openapi, _health(pool, prefill_pool, drain), prometheus],
                    openapi_config=None,  # gateway/openapi.py serves the complete document
                    exception_handlers={GatewayError: _error, HTTPException: _http_error,
                                        Exception: InternalErrors(metrics)},
                    on_startup=on_startup, on_shutdown=on_shutdown,
                    request_max_body_size=cfg.max_body_bytes, plugins=plugins)


def _pools(cfg: GatewayConfig, upstreams: Upstreams, metrics: GatewayMetrics
           ) -> tuple[WorkerPool, WorkerPool | None]:
    """The pool of `workers`, and of `prefill_workers` if there are any, their queues and members
    tracked by `metrics`."""
    # Disaggregated: `workers` decode; these prefill and hand the KV to the decode worker chosen.
    pool = WorkerPool(cfg.workers, upstreams.client, upstream=cfg.upstream,
                      affinity_slack_s=cfg.prefix_affinity_slack_s,
                      roles=frozenset({"decode", "colocated"} if cfg.prefill_workers else {"colocated"}),
                      discovery=cfg.discovery)
    metrics.track_queue(lambda: pool.queued)
    prefill_pool = (WorkerPool(cfg.prefill_workers, upstreams.client, roles=frozenset({"prefill", "colocated"}),
                               affinity_slack_s=cfg.prefix_affinity_slack_s, discovery=cfg.discovery)
                    if cfg.prefill_workers else None)
    metrics.track_pools({"workers": pool, "prefill_workers": prefill_pool})
    return pool, prefill_pool


def _lifecycle(pools: list[WorkerPool], upstreams: Upstreams, tracing: TracerProvider | None
               ) -> tuple[list[Any], list[Any], list[Any]]:
    """The app's startup hooks (each pool polled once, then on its own task), its shutdown hooks (the
    pools stopped, the upstream connections closed, the tracer flushed) and its plugins (tracing's)."""

    async def startup() -> None:
        for p in pools:
            await p.poll_once()
            p.start()

    async def shutdown() -> None:
        for p in pools:
            await p.stop()
        await upstreams.aclose()

    on_shutdown: list[Any] = [shutdown]
    plugins = []
    if tracing is not None:
        from telemetry.tracing import litestar_plugin
        plugins.append(litestar_plugin(exclude=["/health", "/metrics"]))
        on_shutdown.append(tracing.shutdown)
    return [startup], on_shutdown, plugins


GENERATING = ("/v1/completions", "/v1/chat/completions", RESPONSES)  # the routes Forwarder serves


def _proxied(path: str, forward: Forwarder, max_body_bytes: int, drain: Drain) -> ASGIRouteHandler:
    # Litestar's raw-ASGI route handler: @post's per-request signature model and response
    # conversion were 40 % of Litestar's share of a proxied request (0.08 of 0.2 ms, measured);
    # errors still go through the app's exception handlers, streams through Litestar's Stream.
    # copy_scope=False: the endpoint only reads its scope. Unset, Litestar 2 compares the scope with a
    # copy after each request and warns as each app starts.
    @asgi(path, copy_scope=False)
    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        if scope["method"] != "POST":
            raise MethodNotAllowedException(headers={"allow": "POST"})
        raw = await _read_body(scope, receive, max_body_bytes)
        if raw is None:  # the client left before it finished sending: nobody to answer
            return
        try:  # a client that leaves cancels it: the upstream connection closes, so the worker's work stops
            out = await drain.guard(receive, forward(Headers.from_scope(scope), raw, path, arrival))
        except ClientGone:
            return
        except ShuttingDown:
            raise GatewayError(503, "the gateway is shutting down; retry the request", "server_error",
                               code=SHUTTING_DOWN, headers={"retry-after": "1"}) from None
        fields = [(b"content-type", (out.media_type or "application/json").encode())]
        fields += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.headers.items()]
        if isinstance(out, Stream):
            await _send_stream(out.status_code, fields, out.iterator, receive, send, drain)  # type: ignore[arg-type]
            return
        fields.append((b"content-length", str(len(out.content)).encode()))
        await send({"type": "http.response.start", "status": out.status_code, "headers": fields})
        await send({"type": "http.response.body", "body": out.content})

    return endpoint


def _authorizer(cfg: GatewayConfig) -> Callable[[Headers], str | None]:
    def authorized(headers: Headers) -> str | None:
        """The request's API key; with keys configured, an unknown one is refused (OpenAI's 401)."""
        api_key = _bearer(headers.get("authorization"))
        if cfg.api_keys and api_key not in cfg.api_keys:
            raise GatewayError(401, "invalid API key", "authentication_error", code="invalid_api_key",
                               headers={"www-authenticate": "Bearer"})
        return api_key
    return authorized


def _health(pool: WorkerPool, prefill_pool: WorkerPool | None, drain: Drain) -> Any:
    @get("/health")
    async def health() -> Response[dict[str, Any]]:
        """200 while each pool a request needs has a healthy worker; else 503, naming the empty pool(s)
        (so a load balancer's readiness check takes this gateway out while it can serve nothing), or
        saying it is shutting down."""
        pools = [p for p in (pool, prefill_pool) if p is not None]
        body: dict[str, Any] = {"status": "ok", "workers": {w.url: w.healthy for p in pools for w in p.workers}}
        jobs = (("prefill ", prefill_pool), ("decode " if prefill_pool else "", pool))
        empty = [f"no healthy {job}worker" for job, p in jobs
                 if p is not None and not any(w.healthy for w in p.workers)]
        if drain.draining:
            empty = ["shutting down"]
        if not empty:
            return Response(body)
        return Response(body | {"status": "unavailable", "reason": "; ".join(empty)}, status_code=503)
    return health


def _span_annotator() -> Any:
    """Sets attributes on the current (server) span and, given headers, injects the W3C context."""
    from opentelemetry import trace

    from telemetry.tracing import inject

    def annotate(headers: dict[str, str] | None, attrs: dict[str, Any]) -> None:
        trace.get_current_span().set_attributes(attrs)
        if headers is not None:
            inject(headers)
    return annotate


def _bearer(value: str | None) -> str | None:
    if value and value.lower().startswith("bearer "):
        return value[7:].strip() or None
    return None


async def _send_stream(status: int, fields: list[tuple[bytes, bytes]], chunks: AsyncGenerator[bytes, None],
                       receive: Receive, send: Send, drain: Drain) -> None:
    """Chunks as they come. A client that leaves cancels the relay, whose closing the upstream
    cancels the engine's work (the ASGI server drops writes to a gone client without a word); at a
    shutdown's deadline the stream ends with an error event."""
    await send({"type": "http.response.start", "status": status, "headers": fields})

    async def relay() -> None:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    try:
        await drain.guard(receive, relay())
    except ClientGone:
        return
    except ShuttingDown:
        err = error_body("the gateway is shutting down; the answer is cut short", "server_error", code=SHUTTING_DOWN)
        event = b"data: " + msgspec.json.encode(err) + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
    finally:
        await chunks.aclose()
    await send({"type": "http.response.body", "body": b""})


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request body, refused (413) past `limit` bytes, declared or as it arrives; None if the
    client disconnected first."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
    if int(declared) > limit:
        raise RequestEntityTooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise RequestEntityTooLarge
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _http_error(_: Request, exc: HTTPException) -> Response:
    return Response(http_error_body(exc.status_code, exc.detail), status_code=exc.status_code,
                    headers=exc.headers or None)
