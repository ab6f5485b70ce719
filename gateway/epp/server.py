"""The endpoint picker's process: the ext_proc service and gRPC health on one port (plaintext, or TLS
with a certificate and key), Prometheus metrics over HTTP on another, and the worker pool (health
polls of /load, DNS discovery) on the same event loop as the gRPC server."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.config import GatewayConfig
from gateway.epp.grpc_server import NOT_SERVING, SERVING, GrpcServer, Health, tls_context
from gateway.epp.picker import Picker
from gateway.epp.processor import Processor
from gateway.routing import WorkerPool
from telemetry.metrics import EppMetrics

log = logging.getLogger("flowprefill.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = ("", "liveness")  # "" is the server as a whole (a Kubernetes grpc probe without a service)
READINESS = ("readiness", EXT_PROC_SERVICE)


class CannotListen(Exception):
    """A port the picker was told to use is taken (or the address is not this host's)."""


@dataclass(frozen=True)
class Options:
    host: str = "127.0.0.1"
    port: int = 9002  # the port the InferencePool's endpointPickerRef names (the reference EPP's)
    metrics_port: int = 9090  # 0: no metrics endpoint
    max_endpoints: int = 3
    tls_cert: Path | None = None
    tls_key: Path | None = None


class EndpointPicker:
    """The running picker. Ready (readiness and the ext_proc service SERVING) while the pool has a
    healthy worker, after its first discovery and health checks; alive as long as it answers."""

    def __init__(self, cfg: GatewayConfig, options: Options) -> None:
        self.cfg, self.options = cfg, options
        self.metrics = EppMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=2.0))
        self.pool = WorkerPool(cfg.workers, self.client, upstream=cfg.upstream, discovery=cfg.discovery,
                               affinity_slack_s=cfg.prefix_affinity_slack_s)
        self.metrics.track_pools({"workers": self.pool})
        self.picker = Picker(cfg, self.pool, options.max_endpoints)
        self.health = Health()
        self.server: GrpcServer | None = None
        self._metrics_httpd = None
        self._tracing = None  # the tracer provider, when OTEL_* turn tracing on
        self._ready = False
        self._tasks: list[asyncio.Task[None]] = []

    def bind(self) -> int:
        """Listen (before anything starts, so a taken port is the first thing the user hears): the gRPC
        port (its number, when 0 asked for any) and the metrics port."""
        o = self.options
        processor = Processor(self.picker, self.metrics, self._tracer())
        tls = tls_context(o.tls_cert, o.tls_key) if o.tls_cert is not None and o.tls_key is not None else None
        # a message is at most a body chunk and its envelope
        self.server = GrpcServer(processor.routes() | self.health.routes(), self.cfg.max_body_bytes + 65_536, tls)
        try:
            port = self.server.bind(o.host, o.port)  # no SO_REUSEPORT: a second picker cannot share the port
        except OSError as exc:
            raise CannotListen(f"the endpoint picker on {o.host}:{o.port}: {exc.strerror or exc}") from None
        if o.metrics_port:
            from prometheus_client import start_http_server

            try:
                self._metrics_httpd, _ = start_http_server(o.metrics_port, o.host, registry=self.metrics.registry)
            except OSError as exc:
                raise CannotListen(f"the metrics endpoint on {o.host}:{o.metrics_port}: {exc.strerror}") from None
        return port

    def _tracer(self) -> Any:
        """The tracer of the pick spans, or None when tracing is off (telemetry/tracing.py: OTEL_*)."""
        from telemetry.metrics import flowprefill_version
        from telemetry.tracing import TRACER_NAME, setup_tracing

        self._tracing = setup_tracing("flowprefill-epp")
        return None if self._tracing is None else self._tracing.get_tracer(TRACER_NAME, flowprefill_version())

    async def start(self) -> None:
        for service in LIVENESS:
            self.health.set(service, SERVING)
        for service in READINESS:  # until the pool has been found and checked
            self.health.set(service, NOT_SERVING)
        assert self.server is not None, "bind first"
        await self.server.start()
        await self.pool.poll_once()
        self.pool.start()
        await self._set_ready()
        self._tasks.append(asyncio.get_running_loop().create_task(self._readiness()))

    async def _set_ready(self) -> None:
        ready = self.pool.discovery is None or self.pool.discovery.resolved
        ready = ready and any(w.healthy for w in self.pool.workers)
        if ready != self._ready:
            log.log(logging.INFO if ready else logging.WARNING, "endpoint picker %s",
                    "ready" if ready else "not ready: no healthy worker")
            for service in READINESS:
                self.health.set(service, SERVING if ready else NOT_SERVING)
            self._ready = ready

    async def _readiness(self) -> None:
        while True:
            await asyncio.sleep(self.pool.poll_s)
            await self._set_ready()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking streams; those open get `grace_s` to finish."""
        self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        await self.pool.stop()
        await self.client.aclose()
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        if self._tracing is not None:
            self._tracing.shutdown()  # the spans still batched go out


def serve(cfg: GatewayConfig, options: Options, announce: bool = True) -> int:
    """Run the picker until SIGINT or SIGTERM. CannotListen if a port is taken."""

    async def main() -> None:
        epp = EndpointPicker(cfg, options)
        port = epp.bind()
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        await epp.start()
        if announce:
            scheme = "grpcs" if options.tls_cert else "grpc"
            log.info("endpoint picker at %s://%s:%d → %s%s", scheme, options.host, port, ", ".join(cfg.workers),
                     f"; metrics at http://{options.host}:{options.metrics_port}/metrics" if options.metrics_port
                     else "")
            print(f"{options.host}:{port}", flush=True)
        await stopping.wait()
        await epp.stop()

    asyncio.run(main())
    return 0
