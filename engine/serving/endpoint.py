"""What the worker's endpoint handlers share: the error answer, reading a body, server-sent events."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.response import Stream


class BadRequest(Exception):
    """An OpenAI error answer (the worker app's exception handler writes it)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class EventStream(Stream):
    """Server-sent events that say so: Litestar gives a handler's default media type (JSON, for the
    handlers that also answer JSON) precedence over the response's own, and a strict SSE client
    refuses a stream sent as application/json."""

    def to_asgi_response(self, *args: Any, media_type: Any = None, **kwargs: Any) -> Any:
        return super().to_asgi_response(*args, **kwargs)


def decode_body(raw: bytes, type_: Any) -> Any:
    """A request body as `type_`, or a BadRequest saying what is wrong with it."""
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError:
        raise BadRequest("request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
