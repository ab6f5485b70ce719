"""The gateway's cheap requests: the model list and one model (`GET /v1/models`, `/v1/models/{id}`),
vLLM's `POST /tokenize` and `/detokenize`. No engine work queues behind them, so they skip the EDF
queue and the deadline: any healthy worker answers (another if it cannot be reached), in front of
a plain OpenAI server too (vLLM has tokenize and detokenize; one model is found in its list, which
vLLM serves alone). Classified, traced and counted as the generating requests are, so every
answer says its class and id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import Headers
from litestar.params import FromPath

from engine.protocol.headers import REQUEST_ID_HEADER, SLO_CLASS_HEADER
from engine.protocol.openai import error_body, new_id
from gateway.classify import ClassificationError, classify
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, no_healthy_worker
from gateway.routing import WorkerPool
from telemetry.metrics import GatewayMetrics

Annotate = Callable[[dict[str, str] | None, dict[str, Any]], None]
FORWARDED = ("traceparent", "tracestate", "content-type")


class Lookups:
    def __init__(self, cfg: GatewayConfig, pool: WorkerPool, client: httpx.AsyncClient, metrics: GatewayMetrics,
                 authorize: Callable[[Headers], str | None], annotate: Annotate | None) -> None:
        self.cfg, self.pool, self.client, self.metrics = cfg, pool, client, metrics
        self.authorize, self.annotate = authorize, annotate

    def _ours(self, headers: Headers, prefix: str) -> dict[str, str]:
        """The class (by the request's headers and key: there is no prompt to measure) and the id."""
        try:
            slo = classify(self.cfg, headers, {}, self.authorize(headers))
        except ClassificationError as exc:
            raise GatewayError(400, str(exc), param=exc.param) from None
        return {SLO_CLASS_HEADER: slo.name, REQUEST_ID_HEADER: headers.get(REQUEST_ID_HEADER) or new_id(prefix)}

    async def _ask(self, method: str, path: str, request: Request, ours: dict[str, str]) -> httpx.Response:
        """The first healthy worker's answer (a worker that cannot be reached leaves rotation)."""
        headers = {h: v for h in FORWARDED if (v := request.headers.get(h))}
        headers[REQUEST_ID_HEADER] = ours[REQUEST_ID_HEADER]
        content = await request.body() if method == "POST" else None
        if not self.pool.any_live():  # every worker looked down at the last poll: look again first
            await self.pool.poll_once()
        tried: set[str] = set()
        while (worker := self.pool.pick(tried)) is not None:
            tried.add(worker.url)
            if self.annotate is not None:
                self.annotate(headers, {"flowprefill.request_id": ours[REQUEST_ID_HEADER],
                                        "flowprefill.slo_class": ours[SLO_CLASS_HEADER]})
            try:
                r = await self.client.request(method, f"{worker.url}{path}", content=content, headers=headers)
            except httpx.HTTPError:
                self.pool.mark_failed(worker)
                continue
            if self.annotate is not None:
                self.annotate(None, {"flowprefill.route.worker": worker.url, "flowprefill.route.attempts": len(tried),
                                     "http.upstream.status_code": r.status_code})
            return r
        raise no_healthy_worker(ours)  # counted by the app's error handler

    def _answer(self, status: int, content: bytes, ours: dict[str, str]) -> Response:
        self.metrics.answered(ours[SLO_CLASS_HEADER], status)
        return Response(content, status_code=status, media_type="application/json", headers=ours)

    async def models(self, request: Request) -> Response:
        ours = self._ours(request.headers, "models")
        r = await self._ask("GET", "/v1/models", request, ours)
        return self._answer(r.status_code, r.content, ours)

    async def model(self, request: Request, model_id: FromPath[str]) -> Response:
        """One model from the list (a plain OpenAI server such as vLLM has no route for one)."""
        model_id = model_id.lstrip("/")  # a path parameter: ids may hold slashes ("org/name")
        ours = self._ours(request.headers, "models")
        r = await self._ask("GET", "/v1/models", request, ours)
        if r.status_code != 200:
            return self._answer(r.status_code, r.content, ours)
        try:
            listed = msgspec.json.decode(r.content).get("data") or []
        except (msgspec.DecodeError, AttributeError):
            listed = None
        if not isinstance(listed, list):
            return self._answer(502, msgspec.json.encode(error_body("the worker's model list is not readable",
                                                                    "server_error")), ours)
        found = next((m for m in listed if isinstance(m, dict) and m.get("id") == model_id), None)
        if found is None:
            body = error_body(f"The model {model_id[:256]!r} does not exist", param="model", code="model_not_found")
            return self._answer(404, msgspec.json.encode(body), ours)
        return self._answer(200, msgspec.json.encode(found), ours)

    async def tokenize(self, request: Request) -> Response:
        ours = self._ours(request.headers, "tokenize")
        r = await self._ask("POST", "/tokenize", request, ours)
        return self._answer(r.status_code, r.content, ours)

    async def detokenize(self, request: Request) -> Response:
        ours = self._ours(request.headers, "detokenize")
        r = await self._ask("POST", "/detokenize", request, ours)
        return self._answer(r.status_code, r.content, ours)

    def handlers(self) -> list[Any]:
        return [get("/v1/models")(self.models), get("/v1/models/{model_id:path}")(self.model),
                post("/tokenize", status_code=200)(self.tokenize),
                post("/detokenize", status_code=200)(self.detokenize)]
