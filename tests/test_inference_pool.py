"""The Gateway API Inference Extension example (docs/examples/kubernetes/inference-pool.yaml): the
InferencePool validates against the extension's own CRD schema (vendored: docs/examples/kubernetes/
crds), offline, strictly (no field the schema lacks); the other objects against Kubernetes' schema;
and the objects point at each other: the pool selects the workers of flowprefill.yaml, its
endpointPickerRef is the picker's Service, the picker's arguments are ones `flowprefill epp`
accepts and find the same pods through the workers' headless Service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[1] / "docs" / "examples" / "kubernetes"


def _objects(name: str) -> dict[str, list[dict[str, Any]]]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in yaml.safe_load_all((K8S / name).read_text()):
        by_kind.setdefault(obj["kind"], []).append(obj)
    return by_kind


def _crd_schema(version: str) -> dict[str, Any]:
    crd = yaml.safe_load((K8S / "crds" / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io" and crd["spec"]["names"]["kind"] == "InferencePool"
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(v["schema"]["openAPIV3Schema"])


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the API server applies it: an object's fields not in its `properties` are
    unknown (the server prunes or, strictly, refuses them), unless it keeps them on purpose."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        schema["items"] = _strict(schema["items"])
    return schema


def test_the_inference_pool_matches_the_crd_schema() -> None:
    (pool,) = _objects("inference-pool.yaml")["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    schema = _crd_schema("v1")
    jsonschema.validate(pool, schema)
    ref = pool["spec"]["endpointPickerRef"]  # the schema's CEL rule: a Service reference needs its port
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(set(ports)) == len(ports)  # CEL: unique port numbers
    broken = pool | {"spec": pool["spec"] | {"endpointPickerRef": ref | {"portt": 1}}}
    with pytest.raises(jsonschema.ValidationError):  # the check is strict: a misspelt field fails
        jsonschema.validate(broken, schema)


def test_the_other_objects_match_the_kubernetes_schema() -> None:
    for kind, objs in _objects("inference-pool.yaml").items():
        if kind != "InferencePool":
            for obj in objs:
                kubernetes_validate.validate(obj, "1.32", strict=True)


def test_the_pool_the_picker_and_the_workers_point_at_each_other(tmp_path: Path) -> None:
    from gateway.cli import build_parser
    from gateway.cli.epp import check
    from gateway.config import GatewayConfig

    ours, workers = _objects("inference-pool.yaml"), _objects("flowprefill.yaml")
    assert {k: len(v) for k, v in ours.items()} == {"ConfigMap": 1, "InferencePool": 1, "Service": 1, "Deployment": 1}
    (pool,), (svc,), (epp,), (cm,) = ours["InferencePool"], ours["Service"], ours["Deployment"], ours["ConfigMap"]
    (statefulset,) = workers["StatefulSet"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    (worker,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [worker["ports"][0]["containerPort"]]
    # the endpoint picker reference is the picker's Service and its gRPC port
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"] and svc["spec"]["selector"].items() <= \
        epp["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "epp" and args.host == "0.0.0.0" and args.port == grpc_port["targetPort"]
    assert {p["containerPort"] for p in container["ports"]} == {args.port, args.metrics_port}
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": args.port, "service": "liveness"}
    # the picker's pool: every address of the workers' headless Service, whose selector is the pool's
    headless = next(s for s in workers["Service"] if s["spec"].get("clusterIP") == "None")
    assert args.workers_urls == [f"dns:{headless['metadata']['name']}:{pool['spec']['targetPorts'][0]['number']}"]
    assert headless["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    # its config file and TLS files are where the volumes put them, and the config is one it accepts
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    assert args.config == f"{mounts['config']}/gateway.toml" and volumes["config"]["configMap"]["name"] == \
        cm["metadata"]["name"]
    assert {str(args.tls_cert), str(args.tls_key)} == {f"{mounts['tls']}/tls.crt", f"{mounts['tls']}/tls.key"}
    assert "secret" in volumes["tls"]
    (tmp_path / "gateway.toml").write_text(cm["data"]["gateway.toml"])
    cfg = GatewayConfig.load(tmp_path / "gateway.toml", args.workers_urls)
    for path in (args.tls_cert, args.tls_key):  # the Secret's files, as the pod sees them
        (tmp_path / path.name).touch()
    args.tls_cert, args.tls_key = tmp_path / "tls.crt", tmp_path / "tls.key"
    check(cfg, args)  # nothing the picker would refuse
