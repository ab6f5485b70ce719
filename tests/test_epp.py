"""`flowprefill epp`, the endpoint picker (gateway/epp/): a real `flowprefill epp` process, spoken to
over gRPC with the message sequences Envoy sends in FULL_DUPLEX_STREAMED mode (tests/epp_client.py:
a client built from the same protos, xds-protos), in front of small real workers on 127.0.0.2-4
found through a real DNS server. No Envoy binary can be installed here: these tests hold the picker
to the protocol as specified (the Gateway API Inference Extension's proposal 004, Envoy's ext_proc)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import pytest

pytest.importorskip("envoy.service.ext_proc.v3", reason="needs the epp extra (xds-protos)")

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2
from processes import free_port

from gateway.epp.client import (
    Mode,
    Stream,
    check_health,
    epp_process,
    request_bodies,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from gateway.fleet import Worker, Zone, dns_server, serve_at

NAME = "pool.flowprefill.test"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
BACKLOG_S = [0.0, 0.05, 0.1]  # the workers' predicted backlogs: the order of every fallback list
CHAT = {"authorization": "Bearer sk-chat"}  # keys are configured: every request carries one


class Fleet:
    def __init__(self, stack: ExitStack, tmp_path: Path) -> None:
        self.zone = Zone({NAME: HOSTS})
        dns_port = stack.enter_context(dns_server(self.zone))
        self.port = free_port()
        self.workers = {h: Worker(h, backlog_s=b) for h, b in zip(HOSTS, BACKLOG_S, strict=True)}
        for host, w in self.workers.items():
            stack.enter_context(serve_at(w, host, self.port))
        self.endpoints = [f"{h}:{self.port}" for h in HOSTS]
        self.config = tmp_path / "gateway.toml"
        self.config.write_text(f"""
[api_keys."sk-chat"]
default_class = "interactive"

[api_keys."sk-batch"]
default_class = "batch"
ceiling = "relaxed"

[discovery]
nameservers = ["127.0.0.1"]
port = {dns_port}
interval_s = 0.3
""")
        self.address, self.metrics = stack.enter_context(epp_process(
            tmp_path, "--workers", f"dns:{NAME}:{self.port}", "--config", str(self.config)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ExitStack() as stack:
        yield Fleet(stack, tmp_path_factory.mktemp("epp"))


def run(fleet: Fleet, scenario) -> object:  # type: ignore[no-untyped-def]
    """Run `scenario(stub)` on a fresh channel to the picker."""
    async def main() -> object:
        async with grpc.aio.insecure_channel(fleet.address) as channel:
            return await scenario(pb_grpc.ExternalProcessorStub(channel))
    return asyncio.run(main())


def completion(prompt: str = "Hello", **fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4} | fields).encode()


def routed(answer: pb.ProcessingResponse) -> tuple[dict[str, str], str]:
    """(headers set, envoy.lb's destination) of the answer to the request headers, checked against the
    protocol: the same value in the header and the metadata, the route cache cleared."""
    assert answer.WhichOneof("response") == "request_headers"
    common = answer.request_headers.response
    assert common.clear_route_cache
    headers = set_headers(common.header_mutation)
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert metadata["x-gateway-destination-endpoint"].string_value == headers["x-gateway-destination-endpoint"]
    return headers, headers["x-gateway-destination-endpoint"]


def echoed(answers: list[pb.ProcessingResponse]) -> tuple[bytes, list[int]]:
    """The request body the answers give back (streamed_response chunks), and the chunks' sizes; every
    chunk but the last without end_of_stream."""
    parts = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert all(a.WhichOneof("response") == "request_body" for a in answers)
    assert [p.end_of_stream for p in parts] == [False] * (len(parts) - 1) + [True]
    return b"".join(p.body for p in parts), [len(p.body) for p in parts]


def test_a_body_in_chunks_is_routed_once_it_is_whole_and_echoed(fleet: Fleet) -> None:
    body = completion("Say something. " * 40)

    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> None:
        s = Stream(stub)
        first, *rest = request_bodies(body, 3)
        await s.send(request_headers(CHAT | {"x-request-id": "req-7", "traceparent": "00-" + "a" * 32 + "-"
                                             + "b" * 16 + "-01"}), first, rest[0])
        await asyncio.sleep(0.3)
        assert s.answers == []  # nothing until the whole body is there: the pick needs it
        await s.send(rest[1])
        answers = await s.wait(2)
        headers, endpoints = routed(answers[0])
        assert endpoints.split(",") == fleet.endpoints  # the pick, then the fallbacks, least backlog first
        assert headers["content-length"] == str(len(body))
        assert headers["x-slo-class"] == "interactive" and headers["x-request-id"] == "req-7"
        assert 0 < float(headers["x-slo-ttft-ms"]) <= 250  # what is left of interactive's TTFT target
        assert "traceparent" not in headers  # tracing is off: the data plane forwards the client's own
        assert echoed(answers[1:]) == (body, [len(body)])
        # the response passes through: its headers get the class, its body comes back as it was
        await s.send(response_headers(200, served=endpoints.split(",")[0]))
        await s.send(response_body(b'{"id": "cmpl-1", ', False), response_body(b'"choices": []}', True))
        answers = await s.wait(5)
        assert set_headers(answers[2].response_headers.response.header_mutation) == {"x-slo-class": "interactive"}
        streamed = [a.response_body.response.body_mutation.streamed_response for a in answers[3:]]
        assert [(p.body, p.end_of_stream) for p in streamed] == [(b'{"id": "cmpl-1", ', False),
                                                                  (b'"choices": []}', True)]
        await s.close()
        assert len(s.answers) == 5

    run(fleet, scenario)


def test_a_body_over_62000_bytes_goes_back_in_62000_byte_chunks(fleet: Fleet) -> None:
    body = completion("x" * 150_000)

    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> None:
        s = Stream(stub)
        await s.send(request_headers(CHAT), *request_bodies(body, 4))
        answers = await s.wait(4)
        headers, _ = routed(answers[0])
        assert headers["content-length"] == str(len(body))
        whole, sizes = echoed(answers[1:])
        assert whole == body and sizes == [62_000, 62_000, len(body) - 124_000]
        big = b"y" * 70_000  # a response chunk over the limit is cut too
        await s.send(response_headers(200), response_body(big, True))
        answers = await s.wait(7)
        parts = [a.response_body.response.body_mutation.streamed_response for a in answers[5:]]
        assert [(len(p.body), p.end_of_stream) for p in parts] == [(62_000, False), (8_000, True)]
        await s.close()

    run(fleet, scenario)


def test_a_request_without_a_body_is_routed_on_its_headers(fleet: Fleet) -> None:
    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> None:
        s = Stream(stub)
        await s.send(request_headers(CHAT, end_of_stream=True, path="/v1/models", method="GET"))
        (answer,) = await s.wait(1)
        headers, endpoints = routed(answer)
        assert "content-length" not in headers and endpoints.split(",")[0] == fleet.endpoints[0]
        await s.send(response_headers(200, end_of_stream=True))
        await s.wait(2)
        await s.close()
        assert s.answers[1].WhichOneof("response") == "response_headers"

    run(fleet, scenario)


def test_the_subset_hint_bounds_the_pick_and_an_empty_one_is_503(fleet: Fleet) -> None:
    async def pick(stub: pb_grpc.ExternalProcessorStub, subset: list[str]) -> pb.ProcessingResponse:
        s = Stream(stub)
        await s.send(request_headers(CHAT, subset=subset), *request_bodies(completion(), 1))
        answers = await s.wait(1)
        await s.close()
        return answers[0]

    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> None:
        _, endpoints = routed(await pick(stub, fleet.endpoints[1:]))
        assert endpoints.split(",") == fleet.endpoints[1:]
        _, endpoints = routed(await pick(stub, [HOSTS[2]]))  # a pod named by address only
        assert endpoints == fleet.endpoints[2]
        for subset in ([], ["10.9.9.9:8000"]):
            answer = await pick(stub, subset)
            assert answer.WhichOneof("response") == "immediate_response"
            immediate = answer.immediate_response
            assert immediate.status.code == 503
            assert set_headers(immediate.headers)["x-flowprefill-dropped-reason"] == "no_healthy_worker"
            assert json.loads(immediate.body)["error"]["type"] == "server_error"

    run(fleet, scenario)


def immediate(fleet: Fleet, headers: dict[str, str], body: bytes) -> pb.ImmediateResponse:
    """The picker's immediate response to a request (the stream ends after it)."""
    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> pb.ImmediateResponse:
        s = Stream(stub)
        await s.send(request_headers(headers), *request_bodies(body, 2))
        await asyncio.wait_for(s.ended.wait(), 10)  # the picker ends the stream itself
        (answer,) = s.answers
        assert answer.WhichOneof("response") == "immediate_response"
        return answer.immediate_response
    return run(fleet, scenario)  # type: ignore[return-value]


def test_bad_requests_are_answered_by_the_data_plane(fleet: Fleet) -> None:
    r = immediate(fleet, {}, completion())
    assert r.status.code == 401 and json.loads(r.body)["error"]["code"] == "invalid_api_key"
    assert set_headers(r.headers)["www-authenticate"] == "Bearer"
    r = immediate(fleet, CHAT, b'{"prompt": ')
    assert r.status.code == 400 and json.loads(r.body)["error"]["message"] == "request body is not valid JSON"
    for header in ("x-llm-d-inference-objective", "x-gateway-inference-objective"):  # llm-d's name and the old one
        r = immediate(fleet, CHAT | {header: "urgent"}, completion())
        assert r.status.code == 400 and json.loads(r.body)["error"]["param"] == header


def _until(ok, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_sheddable_request_no_worker_can_serve_in_time_is_429(fleet: Fleet) -> None:
    polls = {h: w.hits["/load"] for h, w in fleet.workers.items()}
    for w in fleet.workers.values():
        w.backlog_s = 30.0  # more than any class's TTFT target
    try:
        _until(lambda: all(w.hits["/load"] >= polls[h] + 2 for h, w in fleet.workers.items()))  # the picker saw it
        r = immediate(fleet, {"authorization": "Bearer sk-batch"}, completion())
        assert r.status.code == 429
        headers = set_headers(r.headers)
        assert headers["x-flowprefill-dropped-reason"] == "predicted_slo_miss" and headers["x-slo-class"] == "batch"
        assert json.loads(r.body)["error"]["code"] == "predicted_slo_miss"

        async def scenario(stub: pb_grpc.ExternalProcessorStub) -> str:  # an interactive one is not sheddable
            s = Stream(stub)
            await s.send(request_headers(CHAT), *request_bodies(completion(), 1))
            answers = await s.wait(1)
            await s.close()
            return routed(answers[0])[0]["x-slo-class"]
        assert run(fleet, scenario) == "interactive"
    finally:
        for w, backlog in zip(fleet.workers.values(), BACKLOG_S, strict=True):
            w.backlog_s = backlog
        polls = {h: w.hits["/load"] for h, w in fleet.workers.items()}
        _until(lambda: all(w.hits["/load"] >= polls[h] + 2 for h, w in fleet.workers.items()))


def test_a_prefix_goes_where_the_served_header_says_it_went(fleet: Fleet) -> None:
    """The data plane may serve a request on a fallback: the endpoint it reports as served is the one
    that takes the request's prefix (and the next turn)."""
    prompt = "A long shared system prompt. " * 60  # past prefix_affinity_chars

    async def turn(stub: pb_grpc.ExternalProcessorStub, served_index: int | None) -> list[str]:
        s = Stream(stub)
        await s.send(request_headers(CHAT), *request_bodies(completion(prompt), 1))
        answers = await s.wait(2)
        endpoints = routed(answers[0])[1].split(",")
        if served_index is not None:
            await s.send(response_headers(200, served=endpoints[served_index]), response_body(b"{}", True))
            await s.wait(4)
        await s.close()
        return endpoints

    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> None:
        first = await turn(stub, served_index=None)  # its prefix has never been served: rendezvous
        assert await turn(stub, None) == first  # still nothing recorded: the same choice again
        fallback = first[1]
        await turn(stub, served_index=1)  # served by the second endpoint
        assert (await turn(stub, None))[0] == fallback  # the prefix is cached there now

    run(fleet, scenario)


def test_health_services_and_metrics(fleet: Fleet) -> None:
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert check_health(fleet.address, service) == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as exc:
        check_health(fleet.address, "no.such.Service")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    metrics = httpx.get(f"http://127.0.0.1:{fleet.metrics}/metrics").text
    assert 'flowprefill_gateway_workers{pool="workers",state="healthy"} 3.0' in metrics
    assert re.search(r'flowprefill_gateway_requests_total\{code="200",slo_class="interactive"\} [1-9]', metrics)
    assert re.search(r'flowprefill_gateway_shed_total\{reason="no_healthy_worker",slo_class="interactive"\} [1-9]',
                     metrics)
    assert re.search(r"flowprefill_gateway_pick_duration_seconds_count [1-9]", metrics)


def test_a_body_mode_the_picker_cannot_serve_fails_the_stream(fleet: Fleet) -> None:
    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> grpc.aio.AioRpcError:
        call = stub.Process()
        await call.write(request_headers(CHAT, protocol=(Mode.BUFFERED, Mode.NONE)))
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.read()
        return exc.value

    error = run(fleet, scenario)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "FULL_DUPLEX_STREAMED" in error.details()


def test_a_response_body_the_data_plane_streams_passes_unchanged(fleet: Fleet) -> None:
    async def scenario(stub: pb_grpc.ExternalProcessorStub) -> None:
        s = Stream(stub)
        await s.send(request_headers(CHAT, protocol=(Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED)),
                     *request_bodies(completion(), 1), response_headers(200), response_body(b"data: {}", False))
        answers = await s.wait(4)
        assert answers[3].WhichOneof("response") == "response_body"
        assert not answers[3].response_body.response.HasField("body_mutation")  # no mutation: as it came
        await s.close()

    run(fleet, scenario)


def test_workers_leave_and_join_the_picks_as_dns_says(fleet: Fleet) -> None:
    async def endpoints(stub: pb_grpc.ExternalProcessorStub) -> pb.ProcessingResponse:
        s = Stream(stub)
        await s.send(request_headers(CHAT), *request_bodies(completion(), 1))
        answers = await s.wait(1)
        await s.close()
        return answers[0]

    def picks() -> pb.ProcessingResponse:
        return run(fleet, endpoints)  # type: ignore[return-value]

    fleet.zone.set(NAME, HOSTS[1:])
    try:
        _until(lambda: routed(picks())[1].split(",") == fleet.endpoints[1:])
        fleet.zone.set(NAME, [])  # every pod gone
        _until(lambda: picks().WhichOneof("response") == "immediate_response")
        assert picks().immediate_response.status.code == 503
        _until(lambda: check_health(fleet.address, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        fleet.zone.set(NAME, HOSTS)
    _until(lambda: picks().WhichOneof("response") == "request_headers"
           and routed(picks())[1].split(",") == fleet.endpoints)
    _until(lambda: check_health(fleet.address, "readiness") == health_pb2.HealthCheckResponse.SERVING)


def test_the_benchmark_s_own_client_counts_the_picker_s_answers(fleet: Fleet) -> None:
    """`bench epp` times latency with hand-written frames (gateway/epp/bench_client.py): they must
    be a stream the picker serves, and their answers counted right."""
    from gateway.epp.bench_client import RawClient

    async def main() -> None:
        client = await RawClient.connect(fleet.address)
        try:
            for _ in range(3):  # more than one: the header table's indexed bytes on the later streams
                sid = client.open([])
                await asyncio.wait_for(client.phase(sid, [request_headers(CHAT).SerializeToString(), *(
                    m.SerializeToString() for m in request_bodies(completion(), 1))], 2), 5)
                await asyncio.wait_for(client.phase(sid, [response_headers(200).SerializeToString(),
                                                          response_body(b"data: {}", True).SerializeToString()],
                                                    4, end=True), 5)
                assert client.calls == {}  # ended: trailers came
        finally:
            await client.close()

    asyncio.run(main())
