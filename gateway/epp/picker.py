"""The endpoint picker's decision: where one request goes, or why it goes nowhere.

The same decision the gateway makes (gateway/app.py), without proxying: the API key's rules, the
SLO class (gateway/classify.py: `x-llm-d-inference-objective`, `x-gateway-inference-objective`,
`x-slo-ttft-ms`, …), the pool's order by predicted backlog with prefix affinity
(gateway/routing.py `WorkerPool.ranked`), and the headers that tell the worker its class and what is
left of its TTFT budget, so that the worker schedules it (preempting a running prefill if it must).

No gRPC here: the ext_proc stream (processor.py) hands the request in and turns the answer into
messages; the benchmark times this alone too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.protocol.slo import SLOClass
from gateway.affinity import Prefix, prefix_key
from gateway.classify import ClassificationError, classify
from gateway.config import GatewayConfig
from gateway.routing import Worker, WorkerPool

DROPPED_REASON = "x-flowprefill-dropped-reason"


@dataclass
class Refusal:
    """No endpoint: the answer the client gets instead (OpenAI's error body)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    slo_class: str = "unclassified"

    def body(self) -> bytes:
        # engine.openai_api.error_body's shape; not imported: that module loads the engine (torch)
        return msgspec.json.encode({"error": {"message": self.message, "type": self.type, "param": self.param,
                                              "code": self.code}})

    @property
    def reason(self) -> str | None:
        return self.headers.get(DROPPED_REASON)


@dataclass
class Pick:
    """Where the request goes: `workers` in the order to try them (the pick, then fallbacks)."""

    slo: SLOClass
    workers: list[Worker]
    headers: dict[str, str]  # set on the request on its way to the worker
    body: bytes  # what the worker gets: the client's body (with the upstream's priority field, if it has one)
    key: Prefix | None
    request: dict[str, Any]

    @property
    def endpoints(self) -> str:
        return ",".join(w.address for w in self.workers)


class Picker:
    def __init__(self, cfg: GatewayConfig, pool: WorkerPool, max_endpoints: int = 3) -> None:
        """`max_endpoints`: how many endpoints an answer lists (the pick, then fallbacks in order)."""
        self.cfg, self.pool, self.max_endpoints = cfg, pool, max_endpoints

    def pick(self, headers: Mapping[str, str], raw: bytes, subset: list[str] | None = None,
             arrival: float | None = None) -> Pick | Refusal:
        """`headers`: the request's, names in lower case (pseudo-headers such as `:path` included);
        `raw`: its body (empty: none); `subset`: the data plane's subset hint, if it sent one
        (only those endpoints may be picked); `arrival`: when the request reached the data plane, as
        far as we know (time.monotonic())."""
        arrival = time.monotonic() if arrival is None else arrival
        api_key = _bearer(headers.get("authorization"))
        if self.cfg.api_keys and api_key not in self.cfg.api_keys:
            return Refusal(401, "invalid API key", "authentication_error", code="invalid_api_key",
                           headers={"www-authenticate": "Bearer"})
        request = _decode(raw)
        if isinstance(request, Refusal):
            return request
        try:
            slo = classify(self.cfg, headers, request, api_key)
        except ClassificationError as exc:
            return Refusal(400, str(exc), param=exc.param)
        key = prefix_key(request, self.cfg.prefix_affinity_chars) if request else None
        among = None if subset is None else self._subset(subset)
        ranked = self.pool.ranked(key=key, among=among)
        ours = {"x-slo-class": slo.name}
        if not ranked:
            message = "no healthy worker" if subset is None else "no healthy worker among the subset hint's endpoints"
            return Refusal(503, message, "server_error", slo_class=slo.name,
                           headers=ours | {"retry-after": "1", DROPPED_REASON: "no_healthy_worker"})
        if slo.sheddable and all(self._ahead_s(w, slo) > slo.ttft_ms / 1000 for w in ranked):
            shed = ours | {"retry-after": "1", DROPPED_REASON: "predicted_slo_miss"}  # the workers' own reason
            return Refusal(429, "the request cannot meet its TTFT target on any worker (predicted); retry later "
                           "or with a looser class", "rate_limit_exceeded", code="predicted_slo_miss",
                           slo_class=slo.name, headers=shed)
        path = headers.get(":path", "")
        rid = headers.get("x-request-id") or f"{'chatcmpl' if 'chat/' in path else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        elapsed_ms = (time.monotonic() - arrival) * 1000
        to_worker = ours | {"x-request-id": rid, "x-slo-ttft-ms": f"{max(1.0, slo.ttft_ms - elapsed_ms):.3f}"}
        if request and self.pool.gated and self.cfg.upstream.priority_field:  # a plain OpenAI server's own knob
            request[self.cfg.upstream.priority_field] = self.cfg.upstream_priority(slo)
            raw = msgspec.json.encode(request)
        return Pick(slo, ranked[:self.max_endpoints], to_worker, raw, key, request)

    def _subset(self, hint: list[str]) -> set[str]:
        """The pool's endpoints the hint names: by `ip:port`, else (an entry naming a pod, or another
        port of it, as llm-d's router matches) by address."""
        exact = set(hint)
        if any(w.address in exact for w in self.pool.workers):
            return exact
        hosts = {_host(e) for e in hint}
        return {w.address for w in self.pool.workers if _host(w.address) in hosts}

    def _ahead_s(self, w: Worker, slo: SLOClass) -> float:
        """The predicted prefill seconds the request would wait for at `w`: its backlog, less the waiting
        requests of classes with a looser TTFT target (which it overtakes: the workers schedule by
        deadline)."""
        looser = sum(s for name, s in w.backlog_by_class.items()
                     if (c := self.cfg.classes.get(name)) is not None and c.ttft_ms > slo.ttft_ms)
        return w.backlog_s - looser


def _decode(raw: bytes) -> dict[str, Any] | Refusal:
    if not raw:
        return {}
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return Refusal(400, "request body is not valid JSON")
    if not isinstance(body, dict):
        return Refusal(400, "request body must be a JSON object")
    return body


def _bearer(value: str | None) -> str | None:
    if value and value.lower().startswith("bearer "):
        return value[7:].strip() or None
    return None


def _host(endpoint: str) -> str:
    """The address of `ip:port`, `[v6]:port`, or of a bare address."""
    if endpoint.startswith("["):
        return endpoint[1:endpoint.find("]")]
    return endpoint.rpartition(":")[0] if endpoint.count(":") == 1 else endpoint
