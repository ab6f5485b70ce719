"""The generating requests' path through the gateway (completions, chat, the Responses API): classify,
stamp the deadline, route to a worker, retry elsewhere when one fails or sheds, answer whole or relay
the stream; with prefill/decode disaggregation, the prefill half first (`PrefillFirst`)."""

from __future__ import annotations

import enum
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from litestar import Response
from litestar.datastructures import Headers
from litestar.response import Stream

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
from engine.protocol.openai import error_body, new_id
from engine.protocol.slo import SHED_REASON, SLOClass
from engine.protocol.worker import LOAD_REPORT_HEADER, reported_backlog_s
from gateway.affinity import Prefix, prefix_key
from gateway.classify import ClassificationError, as_chat_view, classify, estimate_prompt_tokens
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, no_healthy_worker
from gateway.http1 import Http1Response
from gateway.late import Lateness, LateShed
from gateway.netio import UpstreamResponse, UpstreamTransport
from gateway.routing import QueueFull, Worker, WorkerPool
from telemetry.metrics import GatewayMetrics

FORWARDED_HEADERS = ("traceparent", "tracestate", "content-type")
CLIENT_SHARDS = 8
# Worker answers worth another worker: it could not reach something, or was overloaded. A 500 is the
# request tripping a bug there; retried, it would fail every worker's batch it joined.
RETRY_ELSEWHERE = frozenset({502, 503, 504})
SHED_HEADERS = ("retry-after", DROPPED_REASON_HEADER)  # what a shed answer tells the client
RESPONSES = "/v1/responses"  # OpenAI's Responses API: served as chat is, its input read as messages
ID_PREFIXES = {"/v1/chat/completions": "chatcmpl", RESPONSES: "resp"}  # of the ids the gateway gives
Annotate = Callable[[dict[str, str] | None, dict[str, Any]], None]  # span attributes (and propagation)
Upstream = UpstreamResponse | Http1Response


class Upstreams:
    """The connections to the workers. Several small connection pools instead of one large one:
    httpcore walks every pooled connection of a pool on each request, so the cost per request grows
    with the pool."""

    def __init__(self, cfg: GatewayConfig) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        tls = httpx.create_ssl_context()  # one CA bundle for every pool
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=2.0)
        transports = [UpstreamTransport(limits, tls) for _ in range(CLIENT_SHARDS)]
        self.clients = [httpx.AsyncClient(timeout=timeout, transport=t) for t in transports]
        self._clients, self._transports = itertools.cycle(self.clients), itertools.cycle(transports)
        self._timeout = timeout.as_dict()

    @property
    def client(self) -> httpx.AsyncClient:
        """The client of health polls and the cheap requests (gateway/lookups.py)."""
        return self.clients[0]

    def next_client(self) -> httpx.AsyncClient:
        return next(self._clients)

    async def post(self, url: str, raw: bytes, headers: dict[str, str]) -> Upstream:
        """Straight to the connection pool: a client's redirect, auth and cookie machinery has nothing to
        do between a gateway and its workers."""
        return await next(self._transports).post(url, raw, headers, self._timeout)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()


@dataclass
class Job:
    """One request on its way: what the gateway decided for it, and what it met at the workers tried."""

    path: str
    body: dict[str, Any]
    raw: bytes
    slo: SLOClass
    rid: str
    ours: dict[str, str]  # the headers every answer to it carries: its class and id
    upstream_headers: dict[str, str]
    deadline: float  # of its first token, fixed at the gateway's arrival
    key: Prefix | None  # prefix affinity's (gateway/affinity.py)
    tokens: int = 0  # what it counts against a gated server's token budget (`WorkerPool.charge`)
    prompt_tokens: int = 0  # its prompt's estimated tokens (gated: the size its slack is judged by)
    held: int = 0  # of which the worker it is at holds now (until its first token, or its end)
    sent_at: float = 0.0  # when the worker it is at got it, until its first token came back
    tried: set[str] = field(default_factory=set)
    shed: Upstream | None = None  # the last worker's answer that shed it
    failed: tuple[int, bytes] | None = None  # the last worker's 5xx answer (status, body)

    def prefilled(self, pool: WorkerPool, worker: Worker, metrics: GatewayMetrics) -> None:
        """Its first token is back: how long it took is seen, the prompt tokens it held at `worker`
        go back (once)."""
        if self.sent_at:
            seconds = time.monotonic() - self.sent_at
            pool.first_token(self.prompt_tokens, seconds)
            metrics.first_token(self.slo.name, seconds)
            self.sent_at = 0.0
        if self.held:
            pool.prefilled(worker, self.held)
            self.held = 0

    def release(self, pool: WorkerPool, worker: Worker) -> None:
        """It is done at `worker`: its slot, and the tokens it still holds there, go back."""
        pool.release(worker, self.held)
        self.held = 0


class Next(enum.Enum):
    RETRY = "another worker may take it"
    GIVE_UP = "another worker would fail the same way"


class Forwarder:
    """The generating routes: `await forwarder(headers, raw body, path, arrival)` is the answer."""

    def __init__(self, cfg: GatewayConfig, pool: WorkerPool, prefill: PrefillFirst | None, upstreams: Upstreams,
                 metrics: GatewayMetrics, authorize: Callable[[Headers], str | None],
                 annotate: Annotate | None) -> None:
        self.cfg, self.pool, self.prefill, self.upstreams = cfg, pool, prefill, upstreams
        self.metrics, self.authorize, self.annotate = metrics, authorize, annotate

    async def __call__(self, headers: Headers, raw: bytes, path: str, arrival: float) -> Response | Stream:
        job = self.prepare(headers, raw, path, arrival)
        if not self.pool.any_live():  # every worker looked down at the last poll: look again before refusing
            await self.pool.poll_once()
        while (worker := await self._acquire(job)) is not None:
            job.tried.add(worker.url)
            outcome = await self._try(job, worker)
            if outcome is Next.GIVE_UP:
                break
            if outcome is not Next.RETRY:
                return outcome
        return self._give_up(job)

    def prepare(self, headers: Headers, raw: bytes, path: str, arrival: float) -> Job:
        """The request classified, named and stamped; 401 and 400 for what it cannot be."""
        api_key = self.authorize(headers)  # before the body: an unknown client learns nothing else
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise GatewayError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        view = as_chat_view(body) if path == RESPONSES else body  # its prompt, as the others say it
        try:
            slo = classify(self.cfg, headers, view, api_key)
        except ClassificationError as exc:
            raise GatewayError(400, str(exc), param=exc.param) from None
        rid = headers.get(REQUEST_ID_HEADER) or new_id(ID_PREFIXES.get(path, "cmpl"))
        if self.prefill is not None and headers.get(REQUEST_ID_HEADER):  # it keys the KV hand-off:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # two requests reusing a client's id must not share one
        if self.pool.gated and self.cfg.upstream.priority_field:  # a plain OpenAI server: its own priority knob
            body[self.cfg.upstream.priority_field] = self.cfg.upstream_priority(slo)
            raw = msgspec.json.encode(body)
        elapsed_ms = (time.monotonic() - arrival) * 1000
        upstream_headers = {h: v for h in FORWARDED_HEADERS if (v := headers.get(h))}
        upstream_headers |= {SLO_CLASS_HEADER: slo.name, REQUEST_ID_HEADER: rid,
                             # the deadline was fixed at gateway arrival: the worker gets what is left
                             SLO_TTFT_HEADER: f"{max(1.0, slo.ttft_ms - elapsed_ms):.3f}",
                             SLO_TPOT_HEADER: f"{slo.tbt_ms:.3f}"}
        if self.annotate is not None:
            self.annotate(upstream_headers, {
                "gen_ai.operation.name": "text_completion" if path == "/v1/completions" else "chat",
                "gen_ai.request.model": str(body.get("model") or ""),
                "flowprefill.request_id": rid, "flowprefill.slo_class": slo.name,
                "flowprefill.ttft_target_ms": slo.ttft_ms,
                "flowprefill.deadline_unix_ms": time.time() * 1000 + slo.ttft_ms - elapsed_ms,
                "flowprefill.stream": bool(body.get("stream"))})
        # Where its prefix may be cached: the prefill workers' when disaggregated (decode imports KV).
        prompt_tokens = estimate_prompt_tokens(view) if self.pool.gated else 0
        return Job(path, body, raw, slo, rid, {SLO_CLASS_HEADER: slo.name, REQUEST_ID_HEADER: rid}, upstream_headers,
                   arrival + slo.ttft_ms / 1000, prefix_key(view, self.cfg.prefix_affinity_chars),
                   self.pool.charge(prompt_tokens), prompt_tokens)

    async def _acquire(self, job: Job) -> Worker | None:
        """The next worker to try (in front of plain servers: once a slot is free, by latest start)."""
        late = Lateness(job.slo.late_bound_ms / 1000, job.slo.late == "shed")
        try:
            worker = await self.pool.acquire(job.deadline, job.tried, None if self.prefill is not None else job.key,
                                             late, job.tokens, job.prompt_tokens, bool(job.body.get("stream")))
        except QueueFull:
            raise GatewayError(503, "the gateway's queue is full", "server_error", headers=job.ours | {
                "retry-after": "1", DROPPED_REASON_HEADER: "queue_full"}) from None
        except LateShed:
            raise GatewayError(429, f"the request's TTFT deadline ({job.slo.ttft_ms:g} ms, class {job.slo.name!r})"
                               " could no longer be met while it waited at the gateway", "rate_limit_error",
                               headers=job.ours | {"retry-after": "1", DROPPED_REASON_HEADER: SHED_REASON}) from None
        job.held = job.tokens if worker is not None else 0
        if worker is not None and not job.tried:  # its wait at the gateway (a retry's is not a new one)
            self.metrics.waited(job.slo.name, time.monotonic() - (job.deadline - job.slo.ttft_ms / 1000))
        job.sent_at = time.monotonic() if worker is not None and job.body.get("stream") else 0.0
        return worker

    async def _try(self, job: Job, worker: Worker) -> Response | Stream | Next:
        """One worker's go at the request: its answer, or what to do next."""
        to_worker = job.upstream_headers
        if self.prefill is not None:
            try:
                refused = await self.prefill.run(worker, job)
            except GatewayError as exc:
                job.release(self.pool, worker)
                exc.headers |= job.ours
                raise
            if isinstance(refused, Response):
                job.release(self.pool, worker)
                refused.headers.update(job.ours)
                return refused
            to_worker = job.upstream_headers | refused | {KV_ID_HEADER: job.rid}
        try:
            up = await self.upstreams.post(f"{worker.url}{job.path}", job.raw, to_worker)
        except httpx.HTTPError:
            job.release(self.pool, worker)
            self.pool.mark_failed(worker)
            return Next.RETRY  # nothing was sent to the client yet: retry elsewhere
        except BaseException:  # the client went away while it was sent: its slot and tokens go back
            job.release(self.pool, worker)
            raise
        if up.headers.get(DROPPED_REASON_HEADER):  # shed there: another worker may take it
            try:
                await up.aread()
                job.shed = up
            except httpx.HTTPError:  # the connection broke: as if it had not answered
                self.pool.mark_failed(worker)
            finally:
                await up.aclose()
                job.release(self.pool, worker)
            return Next.RETRY
        if up.status_code >= 500:
            return await self._failed(job, worker, up)
        return await self._answer(job, worker, up)

    async def _failed(self, job: Job, worker: Worker, up: Upstream) -> Next:
        """A worker's 5xx: kept for the client, tried elsewhere when another worker may do better."""
        try:
            content = await up.aread()
        except httpx.HTTPError:
            content = None
        finally:
            await up.aclose()
            job.release(self.pool, worker)
        if content is None:  # the connection broke: as if it had not answered
            self.pool.mark_failed(worker)
            return Next.RETRY
        self.pool.record_error(worker)
        job.failed = (up.status_code, content)
        return Next.RETRY if up.status_code in RETRY_ELSEWHERE else Next.GIVE_UP

    async def _answer(self, job: Job, worker: Worker, up: Upstream) -> Response | Stream:
        """The worker's answer to the client, whole or streamed."""
        self.pool.record_ok(worker)
        # its load with this request in it: fresher than the last poll (read only where it is used)
        if (self.cfg.load_reports and up.status_code == 200
                and (backlog_s := reported_backlog_s(up.headers.get(LOAD_REPORT_HEADER, ""))) is not None):
            self.pool.reported(worker, backlog_s)
        if up.status_code != 200 or job.path == RESPONSES:  # a quick refusal, or events before any token:
            job.sent_at = 0.0  # its first bytes tell nothing of the time to first token
        if job.key is not None and self.prefill is None and up.status_code == 200:
            self.pool.prefixes.record(job.key, worker.url)  # its prompt is cached there now
        # (the content type travels as the response's media type: a header too would send it twice;
        # the worker's x-request-id, which it made unique if the client's was in use there)
        headers = job.ours | {k: v for k, v in up.headers.items() if k in (PREDICTED_MISS_HEADER, REQUEST_ID_HEADER)}
        if self.annotate is not None:
            self.annotate(None, {"flowprefill.route.worker": worker.url, "flowprefill.route.attempts": len(job.tried),
                                 "flowprefill.route.prefix_affinity": job.key is not None,
                                 "flowprefill.route.prefix_match_chars": job.key.matched_chars if job.key else 0,
                                 "http.upstream.status_code": up.status_code})
        self.metrics.answered(job.slo.name, up.status_code)
        if job.body.get("stream"):
            return Stream(relay(up, worker, self.pool, job, self.metrics), status_code=up.status_code, headers=headers,
                          media_type=up.headers.get("content-type", "text/event-stream"))
        try:
            content = await up.aread()
        except httpx.HTTPError:
            self.pool.mark_failed(worker)
            raise GatewayError(502, f"worker {worker.url} failed mid-response", "server_error",
                               headers=job.ours) from None
        finally:
            await up.aclose()
            job.release(self.pool, worker)
        return Response(content, status_code=up.status_code, headers=headers,
                        media_type=up.headers.get("content-type", "application/json"))

    def _give_up(self, job: Job) -> Response:
        """No worker served it: the reason a worker gave, or that none is healthy."""
        if job.shed is not None:  # every worker shed it: the client gets the reason and when to retry
            if self.annotate is not None:
                self.annotate(None, {"flowprefill.shed_reason": job.shed.headers.get(DROPPED_REASON_HEADER, ""),
                                     "flowprefill.route.attempts": len(job.tried)})
            self.metrics.answered(job.slo.name, job.shed.status_code, job.shed.headers.get(DROPPED_REASON_HEADER))
            return Response(job.shed.content, status_code=job.shed.status_code, media_type="application/json",
                            headers=job.ours | {k: v for k, v in job.shed.headers.items() if k in SHED_HEADERS})
        if job.failed is not None:  # the worker's own error body: what went wrong there, not "no worker"
            status, content = job.failed
            self.metrics.answered(job.slo.name, status)
            return Response(content, status_code=status, media_type="application/json", headers=job.ours)
        raise no_healthy_worker(job.ours)


class PrefillFirst:
    """Prefill/decode disaggregation: a request's prefill half on a prefill worker, which hands its KV
    to the decode worker chosen for the rest."""

    def __init__(self, pool: WorkerPool, upstreams: Upstreams, metrics: GatewayMetrics) -> None:
        self.pool, self.upstreams, self.metrics = pool, upstreams, metrics

    async def run(self, decode: Worker, job: Job) -> Response | dict[str, str]:
        """When the KV is at `decode`, the headers that tell it what the prefill found (its cached prompt
        tokens); else the answer the client gets (shed, bad input). GatewayError with no prefill worker."""
        first = msgspec.json.encode(self.first_half(job.body))
        tried: set[str] = set()
        failed: httpx.Response | None = None
        while (pre := await self.pool.acquire(job.deadline, tried, job.key)) is not None:
            tried.add(pre.url)
            try:
                r = await self.upstreams.next_client().post(f"{pre.url}{job.path}", content=first,
                                                            headers=job.upstream_headers | {KV_TO_HEADER: decode.url})
            except httpx.HTTPError:
                self.pool.mark_failed(pre)
                continue
            finally:
                self.pool.release(pre)
            shed_there = bool(r.headers.get(DROPPED_REASON_HEADER))
            (self.pool.record_error if r.status_code >= 500 and not shed_there else self.pool.record_ok)(pre)
            if r.status_code in RETRY_ELSEWHERE and not shed_there:
                failed = r
                continue
            if r.status_code == 200:
                if job.key is not None:
                    self.pool.prefixes.record(job.key, pre.url)  # its prompt is cached there now
                return {h: v for h in (CACHED_TOKENS_HEADER,) if (v := r.headers.get(h))}
            self.metrics.answered(job.slo.name, r.status_code, r.headers.get(DROPPED_REASON_HEADER))
            return Response(r.content, status_code=r.status_code, media_type="application/json",
                            headers={k: v for k, v in r.headers.items() if k in SHED_HEADERS})
        if failed is not None:  # every prefill worker tried failed: the last one's answer
            self.metrics.answered(job.slo.name, failed.status_code)
            return Response(failed.content, status_code=failed.status_code, media_type="application/json")
        raise no_healthy_worker(pool="prefill worker")

    @staticmethod
    def first_half(body: dict[str, Any]) -> dict[str, Any]:
        """The prefill half's body: its first token only (none for a prompt to score: the prefill
        worker refuses that, before any work), not streamed; the decode worker holds the rest back."""
        limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
        first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")} | {
            "max_tokens": 0 if limit == 0 else 1, "stream": False}
        if isinstance(body.get("min_tokens"), int):
            first["min_tokens"] = min(body["min_tokens"], 1)
        return first


async def relay(up: Upstream, worker: Worker, pool: WorkerPool, job: Job,
                metrics: GatewayMetrics) -> AsyncIterator[bytes]:
    """Pass the worker's SSE through; a stream cut by a dead worker ends with a clean error event.
    Its first chunk means the prompt is prefilled: the tokens it held at the worker go back then."""
    try:
        async for chunk in up.aiter_raw():
            job.prefilled(pool, worker, metrics)
            yield chunk
    except httpx.HTTPError:
        err = error_body(f"worker {worker.url} went away mid-stream", "server_error")
        yield b"data: " + msgspec.json.encode(err) + b"\n\ndata: [DONE]\n\n"
    finally:  # also when our client went away: closing the upstream cancels the engine's work
        await up.aclose()
        job.release(pool, worker)
