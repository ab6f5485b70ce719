"""The Litestar SLO gateway: classify, stamp a deadline, route, forward (streaming or not)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from litestar import Litestar, Request, Response, asgi, get
from litestar.datastructures import Headers
from litestar.exceptions import HTTPException, MethodNotAllowedException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import ASGIRouteHandler
from litestar.response import Stream
from litestar.types import Receive, Scope, Send  # at run time: Litestar reads the annotations

from engine.protocol.headers import (
    CACHED_TOKENS_HEADER,
    DROPPED_REASON_HEADER,
    KV_ID_HEADER,
    KV_TO_HEADER,
    PREDICTED_MISS_HEADER,
    REQUEST_ID_HEADER,
    SLO_CLASS_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
)
from engine.protocol.openai import error_body, http_error_body, new_id
from gateway.affinity import Prefix, prefix_key
from gateway.classify import ClassificationError, as_chat_view, classify
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, no_healthy_worker
from gateway.http1 import Http1Response
from gateway.lookups import Lookups
from gateway.netio import UpstreamResponse, UpstreamTransport
from gateway.openapi import openapi_document
from gateway.routing import QueueFull, Worker, WorkerPool
from telemetry.metrics import GatewayMetrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

FORWARDED_HEADERS = ("traceparent", "tracestate", "content-type")
CLIENT_SHARDS = 8
# Worker answers worth another worker: it could not reach something, or was overloaded. A 500 is the
# request tripping a bug there; retried, it would fail every worker's batch it joined.
RETRY_ELSEWHERE = frozenset({502, 503, 504})
RESPONSES = "/v1/responses"  # OpenAI's Responses API: served as chat is, its input read as messages
ID_PREFIXES = {"/v1/chat/completions": "chatcmpl", RESPONSES: "resp"}  # of the ids the gateway gives


def create_gateway_app(cfg: GatewayConfig, tracing: TracerProvider | None = None) -> Litestar:
    """`tracing`: a configured provider (telemetry.tracing.setup_tracing) turns on a server span per
    request, annotated with the SLO decision and the route, and W3C propagation to the workers."""
    metrics = GatewayMetrics()
    annotate = _span_annotator() if tracing is not None else None

    def _error(_: Request, exc: GatewayError) -> Response:
        metrics.answered(exc.headers.get(SLO_CLASS_HEADER, "unclassified"), exc.status,
                         exc.headers.get(DROPPED_REASON_HEADER))
        return Response(error_body(str(exc), exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)

    # Several small connection pools instead of one large one: httpcore walks every pooled
    # connection of a pool on each request, so the cost per request grows with the pool.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    tls = httpx.create_ssl_context()  # one CA bundle for every pool
    upstreams = [UpstreamTransport(limits, tls) for _ in range(CLIENT_SHARDS)]
    clients = [httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=2.0), transport=t)
               for t in upstreams]
    shards, transports = itertools.cycle(clients), itertools.cycle(upstreams)
    upstream_timeout = httpx.Timeout(cfg.request_timeout_s, connect=2.0).as_dict()
    client = clients[0]  # health polls and /v1/models
    # Disaggregated: `workers` decode; these prefill and hand the KV to the decode worker chosen.
    pool = WorkerPool(cfg.workers, client, upstream=cfg.upstream, affinity_slack_s=cfg.prefix_affinity_slack_s,
                      roles=frozenset({"decode", "colocated"} if cfg.prefill_workers else {"colocated"}))
    metrics.track_queue(lambda: pool.queued)
    prefill_pool = (WorkerPool(cfg.prefill_workers, client, roles=frozenset({"prefill", "colocated"}),
                               affinity_slack_s=cfg.prefix_affinity_slack_s) if cfg.prefill_workers else None)

    async def prefill_first(decode: Worker, path: str, body: dict[str, Any], headers: dict[str, str],
                            deadline: float, slo_name: str, key: Prefix | None) -> Response | dict[str, str]:
        """The prefill half on a prefill worker, its KV sent to `decode`. When the KV is there, the
        headers that tell the decode worker what the prefill found (its cached prompt tokens); else the
        answer the client gets (shed, bad input). Raises GatewayError with no prefill worker."""
        assert prefill_pool is not None
        # its first token only (none for a prompt to score: the prefill worker refuses that, before work)
        limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
        first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")} | {
            "max_tokens": 0 if limit == 0 else 1, "stream": False}
        if isinstance(body.get("min_tokens"), int):  # the decode worker holds the rest back
            first["min_tokens"] = min(body["min_tokens"], 1)
        tried: set[str] = set()
        failed: httpx.Response | None = None
        while (pre := await prefill_pool.acquire(deadline, tried, key)) is not None:
            tried.add(pre.url)
            try:
                r = await next(shards).post(f"{pre.url}{path}", content=msgspec.json.encode(first),
                                      headers=headers | {KV_TO_HEADER: decode.url})
            except httpx.HTTPError:
                prefill_pool.mark_failed(pre)
                continue
            finally:
                prefill_pool.release(pre)
            shed_there = bool(r.headers.get(DROPPED_REASON_HEADER))
            (prefill_pool.record_error if r.status_code >= 500 and not shed_there else prefill_pool.record_ok)(pre)
            if r.status_code in RETRY_ELSEWHERE and not shed_there:
                failed = r
                continue
            if r.status_code == 200:
                if key is not None:
                    prefill_pool.prefixes.record(key, pre.url)  # its prompt is cached there now
                return {h: v for h in (CACHED_TOKENS_HEADER,) if (v := r.headers.get(h))}
            keep = ("retry-after", DROPPED_REASON_HEADER)
            metrics.answered(slo_name, r.status_code, r.headers.get(DROPPED_REASON_HEADER))
            return Response(r.content, status_code=r.status_code, media_type="application/json",
                            headers={k: v for k, v in r.headers.items() if k in keep})
        if failed is not None:  # every prefill worker tried failed: the last one's answer
            metrics.answered(slo_name, failed.status_code)
            return Response(failed.content, status_code=failed.status_code, media_type="application/json")
        raise no_healthy_worker(pool="prefill worker")

    async def forward(headers: Headers, raw: bytes, path: str, arrival: float) -> Response | Stream:
        api_key = authorized(headers)  # before the body: an unknown client learns nothing else
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise GatewayError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        view = as_chat_view(body) if path == RESPONSES else body  # its prompt, as the others say it
        try:
            slo = classify(cfg, headers, view, api_key)
        except ClassificationError as exc:
            raise GatewayError(400, str(exc), param=exc.param) from None
        rid = headers.get(REQUEST_ID_HEADER) or new_id(ID_PREFIXES.get(path, "cmpl"))
        if prefill_pool is not None and headers.get(REQUEST_ID_HEADER):  # it keys the KV hand-off:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # two requests reusing a client's id must not share one
        ours = {SLO_CLASS_HEADER: slo.name, REQUEST_ID_HEADER: rid}
        deadline = arrival + slo.ttft_ms / 1000
        if pool.gated and cfg.upstream.priority_field:  # a plain OpenAI server: its own priority knob
            body[cfg.upstream.priority_field] = cfg.upstream_priority(slo)
            raw = msgspec.json.encode(body)
        elapsed_ms = (time.monotonic() - arrival) * 1000
        upstream_headers = {h: v for h in FORWARDED_HEADERS if (v := headers.get(h))}
        upstream_headers |= {SLO_CLASS_HEADER: slo.name, REQUEST_ID_HEADER: rid,
                             # the deadline was fixed at gateway arrival: the worker gets what is left
                             SLO_TTFT_HEADER: f"{max(1.0, slo.ttft_ms - elapsed_ms):.3f}",
                             SLO_TPOT_HEADER: f"{slo.tbt_ms:.3f}"}
        if annotate is not None:
            annotate(upstream_headers, {
                "gen_ai.operation.name": "text_completion" if path == "/v1/completions" else "chat",
                "gen_ai.request.model": str(body.get("model") or ""),
                "flowprefill.request_id": rid, "flowprefill.slo_class": slo.name,
                "flowprefill.ttft_target_ms": slo.ttft_ms,
                "flowprefill.deadline_unix_ms": time.time() * 1000 + slo.ttft_ms - elapsed_ms,
                "flowprefill.stream": bool(body.get("stream"))})
        tried: set[str] = set()
        # Where its prefix may be cached: the prefill workers' when disaggregated (decode imports KV).
        key = prefix_key(view, cfg.prefix_affinity_chars)
        shed: UpstreamResponse | Http1Response | None = None
        failed: tuple[int, bytes] | None = None  # the last worker's 5xx answer (status, body)
        if pool.pick() is None:  # every worker looked down at the last poll: look again before refusing
            await pool.poll_once()
        while True:
            try:
                worker = await pool.acquire(deadline, tried, None if prefill_pool is not None else key)
            except QueueFull:
                raise GatewayError(503, "the gateway's queue is full", "server_error", headers=ours | {
                    "retry-after": "1", DROPPED_REASON_HEADER: "queue_full"}) from None
            if worker is None:
                break
            tried.add(worker.url)
            to_worker = upstream_headers
            if prefill_pool is not None:
                try:
                    refused = await prefill_first(worker, path, body, upstream_headers, deadline, slo.name, key)
                except GatewayError as exc:
                    pool.release(worker)
                    exc.headers |= ours
                    raise
                if isinstance(refused, Response):
                    pool.release(worker)
                    refused.headers.update(ours)
                    return refused
                to_worker = upstream_headers | refused | {KV_ID_HEADER: rid}
            try:
                # Straight to the connection pool: a client's redirect, auth and cookie machinery
                # has nothing to do between a gateway and its workers.
                up = await next(transports).post(f"{worker.url}{path}", raw, to_worker, upstream_timeout)
            except httpx.HTTPError:
                pool.release(worker)
                pool.mark_failed(worker)
                continue  # nothing was sent to the client yet: retry elsewhere
            if up.headers.get(DROPPED_REASON_HEADER):  # shed there: another worker may take it
                shed = up
                await up.aread()
                await up.aclose()
                pool.release(worker)
                continue
            if up.status_code >= 500:
                try:
                    content = await up.aread()
                except httpx.HTTPError:
                    content = None
                finally:
                    await up.aclose()
                    pool.release(worker)
                if content is None:  # the connection broke: as if it had not answered
                    pool.mark_failed(worker)
                    continue
                pool.record_error(worker)
                failed = (up.status_code, content)
                if up.status_code in RETRY_ELSEWHERE:
                    continue
                break
            pool.record_ok(worker)
            if key is not None and prefill_pool is None and up.status_code == 200:
                pool.prefixes.record(key, worker.url)  # its prompt is cached there now
            # (the content type travels as the response's media type: a header too would send it twice;
            # the worker's x-request-id, which it made unique if the client's was in use there)
            answer_headers = ours | {k: v for k, v in up.headers.items()
                                     if k in (PREDICTED_MISS_HEADER, REQUEST_ID_HEADER)}
            if annotate is not None:
                annotate(None, {"flowprefill.route.worker": worker.url, "flowprefill.route.attempts": len(tried),
                                "flowprefill.route.prefix_affinity": key is not None,
                                "flowprefill.route.prefix_match_chars": key.matched_chars if key else 0,
                                "http.upstream.status_code": up.status_code})
            metrics.answered(slo.name, up.status_code)
            if body.get("stream"):
                return Stream(_relay(up, worker, pool), status_code=up.status_code, headers=answer_headers,
                              media_type=up.headers.get("content-type", "text/event-stream"))
            try:
                content = await up.aread()
            except httpx.HTTPError:
                pool.mark_failed(worker)
                raise GatewayError(502, f"worker {worker.url} failed mid-response", "server_error",
                                   headers=ours) from None
            finally:
                await up.aclose()
                pool.release(worker)
            return Response(content, status_code=up.status_code, headers=answer_headers,
                            media_type=up.headers.get("content-type", "application/json"))
        if shed is not None:  # every worker shed it: the client gets the reason and when to retry
            keep = ("retry-after", DROPPED_REASON_HEADER)
            if annotate is not None:
                annotate(None, {"flowprefill.shed_reason": shed.headers.get(DROPPED_REASON_HEADER, ""),
                                "flowprefill.route.attempts": len(tried)})
            metrics.answered(slo.name, shed.status_code, shed.headers.get(DROPPED_REASON_HEADER))
            return Response(shed.content, status_code=shed.status_code, media_type="application/json",
                            headers=ours | {k: v for k, v in shed.headers.items() if k in keep})
        if failed is not None:  # the worker's own error body: what went wrong there, not "no worker"
            status, content = failed
            metrics.answered(slo.name, status)
            return Response(content, status_code=status, media_type="application/json", headers=ours)
        raise no_healthy_worker(ours)

    def proxied(path: str) -> ASGIRouteHandler:
        # Litestar's raw-ASGI route handler: @post's per-request signature model and response
        # conversion were 40 % of Litestar's share of a proxied request (0.08 of 0.2 ms, measured);
        # errors still go through the app's exception handlers, streams through Litestar's Stream.
        @asgi(path)
        async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
            arrival = time.monotonic()
            if scope["method"] != "POST":
                raise MethodNotAllowedException(headers={"allow": "POST"})
            raw = await _read_body(scope, receive, cfg.max_body_bytes)
            if raw is None:  # the client left before it finished sending: nobody to answer
                return
            out = await forward(Headers.from_scope(scope), raw, path, arrival)
            fields = [(b"content-type", (out.media_type or "application/json").encode())]
            fields += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.headers.items()]
            if isinstance(out, Stream):
                await _send_stream(out.status_code, fields, out.iterator, receive, send)  # type: ignore[arg-type]
                return
            fields.append((b"content-length", str(len(out.content)).encode()))
            await send({"type": "http.response.start", "status": out.status_code, "headers": fields})
            await send({"type": "http.response.body", "body": out.content})

        return endpoint

    def authorized(headers: Headers) -> str | None:
        """The request's API key; with keys configured, an unknown one is refused (OpenAI's 401)."""
        api_key = _bearer(headers.get("authorization"))
        if cfg.api_keys and api_key not in cfg.api_keys:
            raise GatewayError(401, "invalid API key", "authentication_error", code="invalid_api_key",
                               headers={"www-authenticate": "Bearer"})
        return api_key

    document = openapi_document()

    @get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return document

    @get("/health")
    async def health() -> Response[dict[str, Any]]:
        """200 while each pool a request needs has a healthy worker; else 503, naming the empty pool(s)
        (so a load balancer's readiness check takes this gateway out while it can serve nothing)."""
        body: dict[str, Any] = {"status": "ok", "workers": {w.url: w.healthy for p in pools for w in p.workers}}
        jobs = (("prefill ", prefill_pool), ("decode " if prefill_pool else "", pool))
        empty = [f"no healthy {job}worker" for job, p in jobs
                 if p is not None and not any(w.healthy for w in p.workers)]
        if not empty:
            return Response(body)
        return Response(body | {"status": "unavailable", "reason": "; ".join(empty)}, status_code=503)

    @get("/metrics", media_type="text/plain; version=0.0.4")
    async def prometheus() -> bytes:
        return metrics.render()

    pools = [p for p in (pool, prefill_pool) if p is not None]

    async def startup() -> None:
        for p in pools:
            await p.poll_once()
            p.start()

    async def shutdown() -> None:
        for p in pools:
            await p.stop()
        for c in clients:
            await c.aclose()

    on_shutdown: list[Any] = [shutdown]

    plugins = []
    if tracing is not None:
        from telemetry.tracing import litestar_plugin
        plugins.append(litestar_plugin(exclude=["/health", "/metrics"]))
        on_shutdown.append(tracing.shutdown)
    lookups = Lookups(cfg, pool, client, metrics, authorized, annotate)
    return Litestar(route_handlers=[*(proxied(p) for p in ("/v1/completions", "/v1/chat/completions", RESPONSES)),
                                    *lookups.handlers(), openapi, health, prometheus],
                    openapi_config=None,  # gateway/openapi.py serves the complete document
                    exception_handlers={GatewayError: _error, HTTPException: _http_error},
                    on_startup=[startup], on_shutdown=on_shutdown,
                    request_max_body_size=cfg.max_body_bytes, plugins=plugins)


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


async def _relay(up: UpstreamResponse | Http1Response, worker: Worker, pool: WorkerPool) -> AsyncIterator[bytes]:
    """Pass the worker's SSE through; a stream cut by a dead worker ends with a clean error event."""
    try:
        async for chunk in up.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        err = error_body(f"worker {worker.url} went away mid-stream", "server_error")
        yield b"data: " + msgspec.json.encode(err) + b"\n\ndata: [DONE]\n\n"
    finally:  # also when our client went away: closing the upstream cancels the engine's work
        await up.aclose()
        pool.release(worker)


async def _send_stream(status: int, fields: list[tuple[bytes, bytes]], chunks: AsyncGenerator[bytes, None],
                       receive: Receive, send: Send) -> None:
    """Chunks as they come. A client that leaves cancels the relay, whose closing the upstream
    cancels the engine's work (the ASGI server drops writes to a gone client without a word)."""
    relay = asyncio.current_task()
    assert relay is not None
    state = {"gone": False, "finished": False}

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        state["gone"] = True
        if not state["finished"]:
            relay.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await send({"type": "http.response.start", "status": status, "headers": fields})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        relay.uncancel()  # the cancel was ours: the request is over
    finally:
        state["finished"] = True
        watcher.cancel()
        await chunks.aclose()


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
