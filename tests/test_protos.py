"""Protobuf modules another package overwrote (telemetry/protos.py): found by their RECORD hashes, said
in one line, and the install this suite runs in has none (the README's command repairs what the epp
extra's xds-protos replaces)."""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path

import pytest

from telemetry.protos import advice, repair_command, replaced

pytestmark = pytest.mark.gateway_only


def _installed(root: Path, name: str, files: dict[str, bytes]) -> None:
    """A distribution `name` installed under `root` as pip writes one: its files and a RECORD of their hashes."""
    info = root / f"{name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    rows = []
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={digest},{len(data)}")
    (info / "RECORD").write_text("\n".join([*rows, f"{info.name}/RECORD,,"]) + "\n")


def test_a_replaced_module_is_found_and_the_repair_names_its_version(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(tmp_path, "fp-probe-proto", {"fp_probe/common_pb2.py": b"InstrumentationScope = 1\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert replaced(("fp-probe-proto",)) == {}
    (tmp_path / "fp_probe/common_pb2.py").write_bytes(b"# an older copy\n")  # what xds-protos does
    damaged = replaced(("fp-probe-proto",))
    assert damaged == {"fp-probe-proto": "1.2.3"}
    assert repair_command(damaged)[-3:] == ["--force-reinstall", "--no-deps", "fp-probe-proto==1.2.3"]
    assert "fp-probe-proto 1.2.3" in advice(damaged) and "-m telemetry.protos --repair" in advice(damaged)
    (tmp_path / "fp_probe/common_pb2.py").unlink()
    assert replaced(("fp-probe-proto",)) == damaged  # a missing module is replaced too


def test_tracing_with_replaced_modules_is_off_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from telemetry import protos, tracing

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setattr(protos, "replaced", lambda owners=protos.OWNERS: {"opentelemetry-proto": "9.9"})
    with caplog.at_level(logging.ERROR, logger="telemetry.tracing"):
        assert tracing.setup_tracing("flowprefill-test") is None
    assert [r.getMessage() for r in caplog.records] == [f"tracing is off: {advice({'opentelemetry-proto': '9.9'})}"]


def test_this_install_has_its_protobuf_modules() -> None:
    """What the OTLP exporters and the endpoint picker import is what their packages installed."""
    assert replaced() == {}, advice(replaced())
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    assert Grpc and Http
