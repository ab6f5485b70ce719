"""Schemathesis against the gateway's OpenAPI document: generated requests (valid and invalid) through
`flowprefill serve` never produce a server error, and every error is an OpenAI error body."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from processes import free_port, start, stop, wait_healthy
from schemathesis.checks import not_a_server_error

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))  # per operation; a one-off deeper run sets more


@pytest.fixture(scope="module")
def served_schema() -> Iterator[schemathesis.BaseSchema]:
    port = free_port(span=2)
    # a small KV cache bounds how long a generated request can decode (max_tokens past it is a 400)
    proc = start("serve", "--model", "tiny", "--port", str(port), "--kv-capacity-tokens", "2048", "--threads", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")
    finally:
        stop(proc)


@pytest.mark.slow
def test_no_server_errors(served_schema: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            response = case.call(timeout=120)
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400:
                body = response.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}, body

        check()
