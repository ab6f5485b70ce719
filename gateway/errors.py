"""The gateway's errors: each answered as an OpenAI error body, counted by the app's handler."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from litestar import Request, Response

from engine.protocol.headers import DROPPED_REASON_HEADER
from engine.protocol.openai import error_body

if TYPE_CHECKING:
    from telemetry.metrics import GatewayMetrics

log = logging.getLogger("flowprefill.gateway")


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers, self.code = status, type_, param, headers or {}, code


def no_healthy_worker(headers: dict[str, str] | None = None, pool: str = "worker") -> GatewayError:
    return GatewayError(503, f"no healthy {pool}", "server_error", headers=(headers or {}) | {
        "retry-after": "1", DROPPED_REASON_HEADER: "no_healthy_worker"})


class InternalErrors:
    """The app's handler for anything else, a bug of ours: a 500 as an OpenAI error body, its traceback
    logged the first time it is raised at a place, a line after that (Litestar's own default is a bare
    `{"status_code":500}` with nothing logged)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, request: Request, exc: Exception) -> Response:
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        key = (type(exc).__name__, f"{where.tb_frame.f_code.co_filename}:{where.tb_lineno}" if where else "")
        if key in self.seen:
            log.error("internal error on %s %s: %s: %s (traceback logged before)", request.method,
                      request.url.path, type(exc).__name__, exc)
        else:
            self.seen.add(key)
            log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        self.metrics.answered("unclassified", 500)
        return Response(error_body(f"internal gateway error ({type(exc).__name__}); the gateway's log has its cause",
                                   "server_error"), status_code=500)
