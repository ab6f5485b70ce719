"""One HTTP request's ext_proc stream, as the data plane sends it in FULL_DUPLEX_STREAMED mode.

The data plane (Envoy) opens a `Process` stream per request and sends, in order: the request's
headers; its body in chunks (the last with `end_of_stream`), or nothing more if the headers ended
the request; then, once a worker answers, the response's headers and body chunks. The picker holds
its answer to the request headers until the whole body is there (it needs the body to classify and
to find the prefix), then answers the headers (the endpoints, `clear_route_cache`) and echoes the
body in chunks of at most 62,000 bytes, Content-Length set. Response headers and body pass through
as they come (the class added as `x-slo-class`). A refused request gets one ImmediateResponse (429
shed, 503 no endpoint, 4xx bad input) and the stream ends.

The worker picked is counted in flight (the pool's load) from the pick until the stream ends; the
data plane says which endpoint of the list really served it (`x-gateway-destination-endpoint-served`)
and that one is counted instead, and takes the request's prefix once it answered 200.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from gateway.epp import messages
from gateway.epp.h2call import Routes, Stream
from gateway.epp.h2wire import FAILED_PRECONDITION, INTERNAL, OK
from gateway.epp.picker import Pick, Picker, Refusal
from gateway.routing import Worker

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from telemetry.metrics import EppMetrics

log = logging.getLogger("flowprefill.epp")


class ProtocolError(Exception):
    """The data plane is configured in a way the picker cannot serve (a body mode it does not speak)."""


class Exchange:
    """The state of one request's stream; `handle` answers each message."""

    def __init__(self, processor: Processor) -> None:
        self.p = processor
        self.arrival = time.monotonic()
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.pick: Pick | None = None
        self.holder: Worker | None = None  # the worker this request is counted in flight at
        self.response_mode = messages.FULL_DUPLEX
        self.request_mode = messages.FULL_DUPLEX

    def handle(self, message: pb.ProcessingRequest) -> tuple[list[pb.ProcessingResponse], bool]:
        """The answers to `message`, and whether the stream is over (an immediate response)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message)
        if kind == "request_body":
            return self._request_body(message.request_body)
        if kind == "request_trailers":  # the request ends with trailers, not with its last body chunk
            if self.pick is not None:
                return [messages.request_trailers()], False
            out, done = self._decide(end_of_stream=False)
            return (out if done else [*out, messages.request_trailers()]), done
        if kind == "response_headers":
            return [self._response_headers(message)], False
        if kind == "response_body":
            chunk = message.response_body
            if self.response_mode != messages.FULL_DUPLEX:
                return [messages.unchanged_response_body()], False
            return messages.response_body(chunk.body, chunk.end_of_stream), False
        if kind == "response_trailers":
            return [messages.response_trailers()], False
        return [], False

    def _request_headers(self, message: pb.ProcessingRequest) -> tuple[list[pb.ProcessingResponse], bool]:
        if message.HasField("protocol_config"):
            self._modes(message.protocol_config)
        self.headers = messages.header_map(message.request_headers)
        self.subset = messages.subset_hint(message)
        if message.request_headers.end_of_stream or self.request_mode == messages.NO_BODY:
            return self._decide(end_of_stream=None)  # no body is coming: pick on the headers alone
        return [], False

    def _modes(self, config: pb.ProtocolConfiguration) -> None:
        """The body modes the data plane says it uses; the picker speaks FULL_DUPLEX_STREAMED (and
        NONE) for requests: in the others the headers' answer would have to go before the body."""
        if config.request_body_mode not in (messages.FULL_DUPLEX, messages.NO_BODY):
            name = messages.MODE_NAMES.Name(config.request_body_mode)
            raise ProtocolError(f"request_body_mode {name}: the endpoint picker needs FULL_DUPLEX_STREAMED "
                                "(as the InferencePool's gateways configure it), or NONE")
        self.request_mode, self.response_mode = config.request_body_mode, config.response_body_mode

    def _request_body(self, chunk: pb.HttpBody) -> tuple[list[pb.ProcessingResponse], bool]:
        self.body.append(chunk.body)
        self.size += len(chunk.body)
        if self.size > self.p.picker.cfg.max_body_bytes:
            return self._refuse(Refusal(413, f"the request body is larger than {self.p.picker.cfg.max_body_bytes} "
                                        "bytes", code="request_too_large")), True
        if not chunk.end_of_stream:
            return [], False
        return self._decide(end_of_stream=True)

    def _decide(self, end_of_stream: bool | None) -> tuple[list[pb.ProcessingResponse], bool]:
        """Pick, and answer the request's headers (and, after them, its body; `end_of_stream` None:
        it has none)."""
        raw = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        decided = self.p.decide(self.headers, raw, self.subset, self.arrival)
        if isinstance(decided, Refusal):
            return self._refuse(decided), True
        self.pick = decided
        self.holder = decided.workers[0]
        self.holder.in_flight += 1
        headers = decided.headers
        if end_of_stream is not None:
            headers = headers | {"content-length": str(len(decided.body))}
        out = [messages.routed(headers, decided.endpoints)]
        if end_of_stream is not None:
            out += messages.request_body(decided.body, end_of_stream)
        return out, False

    def _refuse(self, refusal: Refusal) -> list[pb.ProcessingResponse]:
        self.p.metrics.answered(refusal.slo_class, refusal.status, refusal.reason)
        return [messages.immediate(refusal.status, refusal.body(), refusal.headers, refusal.reason or refusal.message)]

    def _response_headers(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        status = messages.header_map(message.response_headers).get(":status", "")
        pick = self.pick
        if pick is None:  # not routed by us (a data plane that skipped the picker): as it is
            return messages.response_headers({})
        served = messages.served(message)
        if served is not None and self.holder is not None and served != self.holder.address:
            now = next((w for w in self.p.picker.pool.workers if w.address == served), None)
            self._release()
            if now is not None:  # a fallback served it: that one carries it now
                self.holder = now
                now.in_flight += 1
        if status == "200" and pick.key is not None and self.holder is not None:
            self.p.picker.pool.prefixes.record(pick.key, self.holder.url)  # its prompt is cached there now
        self.p.metrics.answered(pick.slo.name, int(status) if status.isdecimal() else 0)
        return messages.response_headers({"x-slo-class": pick.slo.name})

    def _release(self) -> None:
        if self.holder is not None:
            self.p.picker.pool.release(self.holder)
            self.holder = None

    def close(self) -> None:
        self._release()


PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class ProcessCall:
    """One `Process` stream (gateway/epp/h2.py): each message answered as it arrives."""

    def __init__(self, processor: Processor, stream: Stream) -> None:
        self.exchange, self.stream = Exchange(processor), stream

    def message(self, data: bytes) -> None:
        try:
            request = pb.ProcessingRequest.FromString(data)
        except DecodeError as exc:
            self.end(INTERNAL, f"not an ext_proc ProcessingRequest: {exc}")
            return
        try:
            out, done = self.exchange.handle(request)
        except ProtocolError as exc:
            log.error("%s", exc)
            self.end(FAILED_PRECONDITION, str(exc))
            return
        for response in out:
            self.stream.send(response.SerializeToString())
        if done:
            self.end()

    def end(self, code: int = OK, message: str = "") -> None:
        """The stream is over (the client's end, an immediate response, or `code`'s failure)."""
        self.exchange.close()
        self.stream.finish(code, message)

    def cancel(self) -> None:
        self.exchange.close()


class Processor:
    """The ext_proc service: one `Exchange` per stream."""

    def __init__(self, picker: Picker, metrics: EppMetrics, tracer: Tracer | None = None) -> None:
        self.picker, self.metrics, self.tracer = picker, metrics, tracer

    def routes(self) -> Routes:
        return {PROCESS: lambda stream: ProcessCall(self, stream)}

    def decide(self, headers: dict[str, str], raw: bytes, subset: list[str] | None, arrival: float) -> Pick | Refusal:
        """The pick, timed, and traced when tracing is on (a span joining the request's trace, whose
        context then goes on to the worker)."""
        t0 = time.perf_counter()
        if self.tracer is None:
            decided = self.picker.pick(headers, raw, subset, arrival)
        else:
            decided = self._traced(headers, raw, subset, arrival)
        self.metrics.observe_pick(time.perf_counter() - t0)
        return decided

    def _traced(self, headers: dict[str, str], raw: bytes, subset: list[str] | None, arrival: float) -> Pick | Refusal:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        assert self.tracer is not None
        parent = propagate.extract(headers)  # the data plane's trace, if the request carries one
        with self.tracer.start_as_current_span("pick", context=parent, kind=SpanKind.SERVER) as span:
            decided = self.picker.pick(headers, raw, subset, arrival)
            if isinstance(decided, Refusal):
                span.set_attributes({"http.response.status_code": decided.status,
                                     "flowprefill.shed_reason": decided.reason or "",
                                     "flowprefill.slo_class": decided.slo_class})
                if decided.status >= 500:
                    span.set_status(Status(StatusCode.ERROR, decided.message))
                return decided
            span.set_attributes(_attributes(decided, headers))
            propagate.inject(decided.headers)  # the worker's spans are this one's children
        return decided


def _attributes(pick: Pick, headers: dict[str, str]) -> dict[str, Any]:
    """The gateway's span attributes (gateway/app.py) for a pick."""
    slo, key = pick.slo, pick.key
    return {"gen_ai.operation.name": "chat" if "chat/" in headers.get(":path", "") else "text_completion",
            "gen_ai.request.model": str(pick.request.get("model") or ""),
            "flowprefill.request_id": pick.headers["x-request-id"], "flowprefill.slo_class": slo.name,
            "flowprefill.ttft_target_ms": slo.ttft_ms, "flowprefill.stream": bool(pick.request.get("stream")),
            "flowprefill.deadline_unix_ms": time.time() * 1000 + float(pick.headers["x-slo-ttft-ms"]),
            "flowprefill.route.worker": pick.workers[0].url, "flowprefill.route.endpoints": pick.endpoints,
            "flowprefill.route.prefix_affinity": key is not None,
            "flowprefill.route.prefix_match_chars": key.matched_chars if key else 0}
