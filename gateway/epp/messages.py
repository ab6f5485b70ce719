"""Envoy ext_proc messages (envoy.service.ext_proc.v3, from the xds-protos package) as the endpoint
picker protocol uses them (Gateway API Inference Extension, proposal 004)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

# A body echoed in FULL_DUPLEX_STREAMED mode goes back in chunks of at most this many bytes: some
# Envoy builds refuse a streamed chunk over 64 KiB, and llm-d's router keeps this margin below it.
CHUNK_BYTES = 62_000
# Namespaces and keys of proposal 004.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
MODE_NAMES = processing_mode_pb2.ProcessingMode.BodySendMode
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """The headers of a request or response message, names in lower case (a repeated one joined
    with commas, as HTTP reads it)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        name = h.key.lower()
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        out[name] = f"{out[name]},{value}" if name in out else value
    return out


# Messages are filled in place (`add`, attributes) rather than built from keyword arguments: upb's
# constructors cost 2-4x as much for these nested messages (12 against 28-50 us for `routed`, here).


def _set(mutation: pb.HeaderMutation, headers: dict[str, str]) -> None:
    """Headers to set, replacing any the message has under those names (ours are the only truth)."""
    options = mutation.set_headers
    for k, v in headers.items():
        option = options.add(append_action=OVERWRITE)
        option.header.key, option.header.raw_value = k, v.encode("latin-1")


def set_headers(headers: dict[str, str]) -> pb.HeaderMutation:
    mutation = pb.HeaderMutation()
    _set(mutation, headers)
    return mutation


def routed(headers: dict[str, str], endpoints: str) -> pb.ProcessingResponse:
    """The answer to the request's headers: where it goes, in a header and in the `envoy.lb`
    dynamic metadata (the same value), with the route cache cleared so the data plane routes again."""
    answer = pb.ProcessingResponse()
    common = answer.request_headers.response
    common.clear_route_cache = True
    _set(common.header_mutation, headers | {DESTINATION: endpoints})
    lb = answer.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value
    lb.fields[DESTINATION].string_value = endpoints
    return answer


def _pieces(body: bytes) -> list[bytes]:
    """`body` in pieces of at most CHUNK_BYTES (one, possibly empty, at least)."""
    return [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]


def request_body(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """`body` as streamed body mutations of at most CHUNK_BYTES each; the last carries `end_of_stream`."""
    return _streamed(body, end_of_stream, "request_body")


def response_body(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    return _streamed(body, end_of_stream, "response_body")


def _streamed(body: bytes, end_of_stream: bool, field: str) -> list[pb.ProcessingResponse]:
    out, pieces = [], _pieces(body)
    for i, piece in enumerate(pieces):
        answer = pb.ProcessingResponse()
        streamed = getattr(answer, field).response.body_mutation.streamed_response
        streamed.SetInParent()  # an empty last piece is still an answer
        streamed.body = piece
        streamed.end_of_stream = end_of_stream and i == len(pieces) - 1
        out.append(answer)
    return out


def response_headers(headers: dict[str, str]) -> pb.ProcessingResponse:
    answer = pb.ProcessingResponse()
    mutation = answer.response_headers.response.header_mutation
    mutation.SetInParent()  # present even with nothing to set: the oneof says which answer this is
    _set(mutation, headers)
    return answer


def unchanged_response_body() -> pb.ProcessingResponse:
    """The answer to a response body the data plane streams or buffers (not full duplex): as it is."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(status: int, body: bytes, headers: dict[str, str], details: str) -> pb.ProcessingResponse:
    """The data plane answers the client itself, with this, and sends the request nowhere."""
    mutation = set_headers({"content-type": "application/json"} | headers)
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body, details=details))


def subset_hint(message: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane allows for this request (its `envoy.lb.subset_hint`), or None
    when it sets none."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("string_value"):  # one endpoint, or several comma-separated
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    return [v.string_value for v in value.list_value.values if v.HasField("string_value")]


def served(message: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the request, as the data plane reports it with the response."""
    namespace = message.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value or None
