"""The gateway's errors: each answered as an OpenAI error body, counted by the app's handler."""

from __future__ import annotations

from engine.protocol.headers import DROPPED_REASON_HEADER


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers, self.code = status, type_, param, headers or {}, code


def no_healthy_worker(headers: dict[str, str] | None = None, pool: str = "worker") -> GatewayError:
    return GatewayError(503, f"no healthy {pool}", "server_error", headers=(headers or {}) | {
        "retry-after": "1", DROPPED_REASON_HEADER: "no_healthy_worker"})
