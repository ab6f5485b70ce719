"""`flowprefill epp` as a process: TLS, tracing (the pick a span of the request's trace, its context
passed on to the worker), and the one-line errors of a command line it cannot serve."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("envoy.service.ext_proc.v3", reason="needs the epp extra (xds-protos)")

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from processes import free_port

import gateway.epp
from gateway.cli import main as cli_main
from gateway.epp.client import Stream, epp_process, request_bodies, request_headers, set_headers
from gateway.fleet import Worker, serve_at

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    port = free_port()
    with serve_at(Worker("w"), "127.0.0.2", port):
        yield f"http://127.0.0.2:{port}"


async def _pick(channel: grpc.aio.Channel, headers: dict[str, str]) -> dict[str, str]:
    s = Stream(pb_grpc.ExternalProcessorStub(channel))
    await s.send(request_headers(headers), *request_bodies(b'{"prompt": "hi", "max_tokens": 1}', 1))
    answers = await s.wait(2)
    await s.close()
    return set_headers(answers[0].request_headers.response.header_mutation)


def test_the_pick_is_a_span_of_the_request_s_trace(tmp_path: Path, worker: str) -> None:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with epp_process(tmp_path, "--workers", worker, env=env) as (address, _):
        async def main() -> dict[str, str]:
            async with grpc.aio.insecure_channel(address) as channel:
                return await _pick(channel, {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
        headers = asyncio.run(main())
    _, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert trace_id == TRACE_ID and span_id != "00f067aa0ba902b7" and flags == "01"  # the pick's span, the parent


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a certificate")
def test_tls(tmp_path: Path, worker: str) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=epp",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with epp_process(tmp_path, "--workers", worker, "--tls-cert", str(cert), "--tls-key", str(key),
                     credentials=credentials) as (address, _):
        async def main() -> dict[str, str]:
            async with grpc.aio.secure_channel(address, credentials) as channel:
                return await _pick(channel, {})
        assert asyncio.run(main())["x-gateway-destination-endpoint"] == worker.removeprefix("http://")

        async def plaintext() -> None:
            async with grpc.aio.insecure_channel(address) as channel:
                await _pick(channel, {})
        with pytest.raises(grpc.aio.AioRpcError):
            asyncio.run(plaintext())


@pytest.mark.parametrize(("argv", "says"), [
    (["--workers", "http://flowprefill-worker-0.flowprefill-worker:8001"], "by IP address"),
    (["--workers", "http://127.0.0.2:8001", "--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
    (["--workers", "http://127.0.0.2:8001", "--endpoints", "0"], "--endpoints must be at least 1"),
    (["--workers", "dns:pool"], "dns:NAME:PORT"),
])
def test_a_command_line_it_cannot_serve_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                    says: str) -> None:
    assert cli_main(["epp", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_disaggregation_is_the_gateway_s(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gw.toml").write_text('prefill_workers = ["http://127.0.0.3:8001"]\n')
    assert cli_main(["epp", "--workers", "http://127.0.0.2:8001", "--config", str(tmp_path / "gw.toml")]) == 2
    assert "needs the gateway" in capsys.readouterr().err


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gateway.epp, "EXTRA", gateway.epp.EXTRA | {"flowprefill_no_such_module": "xds-protos"})
    assert cli_main(["epp", "--workers", "http://127.0.0.2:8001"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "xds-protos" in err and "pip install 'flowprefill[epp]'" in err


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "epp", "--workers", "http://127.0.0.2:8001",
                            "--port", str(port), "--metrics-port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"flowprefill epp: error: the endpoint picker on 127.0.0.1:{port}: ")
    assert r.stderr.count("\n") == 1, r.stderr


def test_every_option_is_documented() -> None:
    from test_docs import _cli_options, _code, _section, _table

    rows = _table(_section("deploy.md", "## The endpoint picker (`flowprefill epp`)"))
    documented = {name for row in rows for name in re.findall(r"`(--[a-z-]+)`", row[0])}
    assert documented == _cli_options("epp")
    defaults = {_code(row[0]): row[1] for row in rows}
    assert defaults["--endpoints"] == "`3`" and defaults["--metrics-port"] == "`9090`"


def test_the_benchmarks_page_has_the_recorded_numbers() -> None:
    import json

    from test_docs import DOCS, RESULTS, _section, _table

    r = json.loads((RESULTS / "epp.json").read_text())
    rows = {row[0]: row for row in _table(_section("benchmarks.md", "## Endpoint picker"))}
    assert rows["added latency per request, p50"][1].startswith(f"**{r['latency']['request_phase_p50_ms']:.2f} ms**")
    assert rows["added latency per request, p99"][1].startswith(f"**{r['latency']['request_phase_p99_ms']:.2f} ms**")
    picks = r["throughput_request_phase"]["one_core_picks_per_s"]
    assert rows["picks per second on one core"][1].startswith(f"**{picks:,.0f}**")
    assert rows["failed requests on removal"][1].startswith(f"**{r['discovery']['failed_requests']}**")
    assert "flowprefill bench epp" in (DOCS / "benchmarks.md").read_text()
