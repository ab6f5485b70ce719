"""The shipped observability stack (telemetry/deploy): files that docker compose, Prometheus and
Grafana will read are well-formed and point at each other."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "telemetry" / "deploy"


def test_compose_mounts_exist_and_ports_match() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"jaeger", "prometheus", "grafana"}
    for svc in compose["services"].values():
        assert svc["network_mode"] == "host"  # flowprefill serve runs on the host
        for volume in svc.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"localhost:8000", "localhost:8001"}  # serve's default gateway and first worker


def test_grafana_provisioning_matches_dashboard() -> None:
    sources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/datasources.yml").read_text())
    uids = {d["uid"]: d["type"] for d in sources["datasources"]}
    dashboard = json.loads((DEPLOY / "grafana/dashboards/flowprefill.json").read_text())
    picker = dashboard["templating"]["list"][0]
    assert uids[picker["current"]["value"]] == picker["query"] == "prometheus"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "attainment", "goodput", "preemptions", "queue", "kv"):
        assert topic in titles
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs Debian's prometheus package")
def test_promtool_accepts_scrape_config() -> None:
    subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], check=True,
                   capture_output=True)
