"""Run FlowPrefill's routing as the endpoint picker (EPP) of the Kubernetes Gateway API Inference
Extension: an Envoy-based gateway (Envoy Gateway, kgateway, Istio, agentgateway, GKE) asks it, over
Envoy's ext_proc gRPC protocol, which worker takes each request. The pick is the gateway's: SLO class
(x-llm-d-inference-objective, x-slo-class, x-slo-ttft-ms, API keys), least predicted backlog from
each worker's /load, prefix affinity; the answer an ordered list of endpoints. gRPC health
(liveness, readiness) on the same port; Prometheus metrics on --metrics-port. Needs the epp extra
(pip install 'flowprefill[epp]')."""

from __future__ import annotations

import argparse
import ipaddress
import typing
from pathlib import Path
from urllib.parse import urlsplit

from gateway.cli.common import CommandLineError, add_address, bind, port_number
from gateway.cli.gateway import load_config, worker_urls
from gateway.config import GatewayConfig, Upstream
from gateway.discovery import split_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", dest="workers_urls", required=True, type=worker_urls, metavar="URLS",
                        help="the pool: dns:NAME:PORT for every address of NAME (the headless Service over the "
                             "InferencePool's pods), or comma-separated worker URLs by IP address")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="gateway TOML: SLO classes, API keys, rules, [upstream], [discovery]")
    add_address(parser, port=9002, port_help="gRPC port (ext_proc and health): the InferencePool's "
                "endpointPickerRef port")
    parser.add_argument("--metrics-port", type=_port_or_0, default=9090,
                        metavar="PORT", help="Prometheus /metrics over HTTP on this port (0: none)")
    parser.add_argument("--upstream", choices=typing.get_args(typing.get_type_hints(Upstream)["kind"]),
                        default=None, help="what the workers are (overrides the config's [upstream] kind; default "
                                           f"{Upstream().kind}): openai = plain OpenAI-compatible servers, given the "
                                           "class's priority in the body")
    parser.add_argument("--endpoints", type=int, default=3, metavar="N",
                        help="endpoints each answer lists: the pick, then fallbacks in order, for the data plane's "
                             "retries")
    parser.add_argument("--tls-cert", type=Path, default=None, metavar="FILE",
                        help="serve gRPC over TLS with this certificate (PEM; with --tls-key); without: plaintext")
    parser.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="the certificate's private key")


def _port_or_0(value: str) -> int:
    return 0 if value == "0" else port_number(value)


_port_or_0.__name__ = "port"  # argparse names the type in its error


def check(cfg: GatewayConfig, args: argparse.Namespace) -> None:
    """What the picker cannot serve, as the user's to fix."""
    if cfg.prefill_workers:
        raise CommandLineError("prefill_workers: the endpoint picker sends each request to one worker; "
                               "prefill/decode disaggregation needs the gateway (flowprefill gateway)")
    urls, _ = split_sources(cfg.workers)
    for url in urls:
        try:
            ipaddress.ip_address((urlsplit(url).hostname or "").strip("[]"))
        except ValueError:
            raise CommandLineError(f"--workers {url}: the data plane connects to an endpoint by IP address; "
                                   "name workers by address, or use dns:NAME:PORT") from None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CommandLineError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise CommandLineError(f"{path}: no such file")
    if args.endpoints < 1:
        raise CommandLineError("--endpoints must be at least 1")


def run(args: argparse.Namespace) -> int:
    from gateway.epp import missing_extra

    if problem := missing_extra():
        raise CommandLineError(problem)
    cfg = load_config(args.config, args.workers_urls, kind=args.upstream)
    check(cfg, args)
    for port, what in ((args.port, "the endpoint picker"), (args.metrics_port, "its metrics endpoint")):
        if port:  # a taken port in our words (gRPC's own bind error comes with a line of its core's log)
            bind(args.host, port, what).close()
    from gateway.epp.server import CannotListen, Options, serve

    try:
        return serve(cfg, Options(args.host, args.port, args.metrics_port, args.endpoints, args.tls_cert,
                                  args.tls_key))
    except CannotListen as exc:
        raise CommandLineError(str(exc)) from None
