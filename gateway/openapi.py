"""The gateway's OpenAPI document, generated from the request structs the workers decode (so it cannot
drift from what is accepted). The gateway forwards bodies without decoding them into these types,
so Litestar's own generator would see no request bodies; this one does."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.protocol.headers import OBJECTIVE_HEADERS, REQUEST_ID_HEADER, SLO_CLASS_HEADER, TPOT_HEADERS, TTFT_HEADERS
from engine.protocol.openai import ChatCompletionRequest, CompletionRequest
from engine.protocol.responses import ResponsesRequest
from engine.protocol.tokenize import DetokenizeRequest, TokenizeRequest

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}

def _header(name: str, kind: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "schema": {"type": kind}, "description": description}


_SLO_HEADERS = [
    _header(SLO_CLASS_HEADER, "string", "SLO class to run at (interactive, standard, relaxed, batch, or configured)"),
    *(_header(h, "string", "llm-d's inference objective: an SLO class's name (after x-slo-class)")
      for h in OBJECTIVE_HEADERS),
    *(_header(h, "number", "explicit time-to-first-token target in milliseconds") for h in TTFT_HEADERS),
    *(_header(h, "number", "explicit time-per-output-token (TBT) target in milliseconds") for h in TPOT_HEADERS),
    _header(REQUEST_ID_HEADER, "string", "the request's id (the gateway makes one if none is sent)"),
]


def _openapi_30(schema: Any) -> Any:
    """msgspec writes JSON Schema 2020-12; OpenAPI 3.0 wants `nullable` instead of a null type."""
    if isinstance(schema, list):
        return [_openapi_30(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _openapi_30(v) for k, v in schema.items()}
    for key in ("anyOf", "oneOf"):
        options = out.get(key)
        if options and {"type": "null"} in options:
            rest = [o for o in options if o != {"type": "null"}]
            del out[key]
            if len(rest) == 1:
                out |= rest[0]
            else:
                out[key] = rest
            out["nullable"] = True
    return out


def openapi_document(title: str = "FlowPrefill gateway", version: str = "") -> dict[str, Any]:
    (completion, chat, responses, tokenize, detokenize), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest],
        ref_template="#/components/schemas/{name}")
    components["Error"] = _ERROR
    json_object = {"application/json": {"schema": {"type": "object"}}}
    error = {"description": "an OpenAI error body",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    def lookup(summary: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"summary": summary, "parameters": _SLO_HEADERS[-1:],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": {"description": "ok", "content": json_object}, "default": error}}}

    def generate(summary: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"post": {
            "summary": summary, "parameters": _SLO_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {"description": "the completion (JSON), or server-sent events with `stream: true`",
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                "default": {"description": "an OpenAI error body",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            }}}

    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": version or "0"},
        "paths": {
            "/v1/completions": generate("Create a completion", completion),
            "/v1/chat/completions": generate("Create a chat completion", chat),
            "/v1/responses": generate("Create a response (OpenAI's Responses API)", responses),
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": {"description": "OpenAI model list", "content": json_object}}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "One model", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OpenAI model object", "content": json_object},
                              "default": error}}},
            "/tokenize": lookup("Token ids of a prompt or of chat messages (vLLM's)", tokenize),
            "/detokenize": lookup("The text of token ids (vLLM's)", detokenize),
            "/health": {"get": {"summary": "Gateway and worker health", "responses": {
                "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": _openapi_30(components)},
    }
