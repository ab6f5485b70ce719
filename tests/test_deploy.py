"""The shipped observability stack (telemetry/deploy): files that docker compose, Prometheus and
Grafana will read are well-formed and point at each other."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
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


K8S = Path(__file__).resolve().parents[1] / "docs" / "examples" / "kubernetes"


def test_kubernetes_manifests(tmp_path: Path) -> None:
    from gateway.cli import build_parser
    from gateway.config import GatewayConfig

    docs = list(yaml.safe_load_all((K8S / "flowprefill.yaml").read_text()))
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    assert {k: len(v) for k, v in by_kind.items()} == {"ConfigMap": 1, "Service": 2, "StatefulSet": 1,
                                                       "Deployment": 1}
    (workers,), (gateway,) = by_kind["StatefulSet"], by_kind["Deployment"]
    parser = build_parser()
    for obj in (workers, gateway):
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        args, rest = parser.parse_known_args(container["args"])
        assert not rest, f"{obj['metadata']['name']}: flowprefill does not accept {rest}"
        port = container["ports"][0]["containerPort"]
        assert args.port == port and container["readinessProbe"]["httpGet"]["port"] == port
    wargs = parser.parse_args(workers["spec"]["template"]["spec"]["containers"][0]["args"])
    assert wargs.command == "worker" and wargs.host == "0.0.0.0" and wargs.device == "cuda"
    assert workers["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the gateway routes to exactly the StatefulSet's pods: every address of their headless Service
    gargs = parser.parse_args(gateway["spec"]["template"]["spec"]["containers"][0]["args"])
    svc = workers["spec"]["serviceName"]
    assert gargs.workers_urls == [f"dns:{svc}:{wargs.port}"]
    headless = next(s for s in by_kind["Service"] if s["metadata"]["name"] == svc)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == workers["spec"]["selector"]["matchLabels"]
    # the gateway's config file in the ConfigMap is one GatewayConfig accepts
    (cm,) = by_kind["ConfigMap"]
    mount = gateway["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert gargs.config == f"{mount}/gateway.toml"
    cfg_file = tmp_path / "gateway.toml"
    cfg_file.write_text(cm["data"]["gateway.toml"])
    cfg = GatewayConfig.load(cfg_file, gargs.workers_urls)
    assert cfg.api_keys["sk-batch-jobs"].ceiling == "relaxed"


def test_kubernetes_manifests_match_the_kubernetes_schema() -> None:
    """Each object validates against Kubernetes' own OpenAPI schema (strict: no unknown fields), offline."""
    for obj in yaml.safe_load_all((K8S / "flowprefill.yaml").read_text()):
        kubernetes_validate.validate(obj, "1.32", strict=True)


def test_dockerfile_copies_the_packages() -> None:
    root = K8S.parents[2]
    for name in ("Dockerfile", "Dockerfile.gateway"):
        for line in (K8S / name).read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (root / src).exists(), f"{name}: {src}"


def test_the_gateway_runs_on_a_slim_image_of_the_base_install() -> None:
    """The gateway's image is the install without the engine (the base, with the endpoint picker's
    `epp` extra at most) on a Python image with no CUDA, the workers' the CUDA one with the gpu extra;
    each container runs the image built for it."""
    def image(name: str) -> tuple[str, str, str]:
        text = (K8S / name).read_text()
        (base,) = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
        (install,) = [line for line in text.splitlines() if line.startswith("RUN pip install")]
        return base, install, re.search(r"-t (\S+) \.", text).group(1)  # type: ignore[union-attr]

    gateway_base, gateway_install, gateway_tag = image("Dockerfile.gateway")
    worker_base, worker_install, worker_tag = image("Dockerfile")
    assert "cuda" not in gateway_base and "slim" in gateway_base
    assert re.search(r"'\.(\[epp\])?'", gateway_install), gateway_install
    assert "cuda" in worker_base and "[gpu]" in worker_install
    containers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                  for d in yaml.safe_load_all((K8S / "flowprefill.yaml").read_text()) if d["kind"] != "Service"
                  and d["kind"] != "ConfigMap"}
    assert containers["flowprefill-gateway"]["image"] == gateway_tag
    assert containers["flowprefill-worker"]["image"] == worker_tag
