"""`flowprefill bench health`: a worker answers GET /health while a burst of requests arrives."""

from __future__ import annotations

import json
from pathlib import Path

from engine.bench import health


def test_health_is_probed_through_a_burst(tmp_path: Path) -> None:
    assert health.main(["--burst", "40", "--probe-ms", "10", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "health.json").read_text())
    assert doc["statuses"] == {"200": 40}
    assert doc["idle"]["n"] > 10 and doc["during_burst"]["n"] >= 1
    assert doc["during_burst"]["p99_ms"] >= doc["during_burst"]["p50_ms"] > 0
    assert (tmp_path / "health.png").stat().st_size > 0
