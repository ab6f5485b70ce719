"""The peer benchmark's load generator: one schedule of streamed completions sent open loop to one
contender, TTFT measured at the client.

Why not Locust (loadtest/locustfile.py): the peer benchmark replays the same arrivals against five or
more contenders at every rate; one asyncio loop in the benchmark's own process sends them at their due
times (send lag p99 well under 1 ms at 24 req/s on one core) with nothing to start per run, where a
Locust run is a process of its own (about 2 s to start, 50 runs a sweep) whose gevent pacer and
results go through files. The request bodies are built once, before the clock starts, and are the
same bytes for every contender apart from the model name and the priority field.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import msgspec

from engine.protocol.headers import SLO_CLASS_HEADER, SLO_TTFT_HEADER
from engine.protocol.slo import DEFAULT_CLASSES, SLOClass
from loadtest.priority import class_priorities
from loadtest.results import Record
from loadtest.workload import Workload, synthesize_prompt

PROMPT_VOCAB = 256  # prompts are byte tokens 32..255: in every tokenizer the checkpoint can have


class Arrival(msgspec.Struct, frozen=True):
    index: int
    due_s: float  # from the start of the run
    slo_class: str
    input_tokens: int
    prompt: list[int]


def arrivals(w: Workload, seed: str = "peer") -> list[Arrival]:
    """The schedule's requests with their prompts: the same token ids for every contender and rate
    (the servers run without prefix caching, so a repeated prompt is computed again)."""
    return [Arrival(i, r.arrival_s, r.slo_class, r.input_tokens,
                    synthesize_prompt(r.input_tokens, PROMPT_VOCAB, seed=f"{seed}-{i}"))
            for i, r in enumerate(w.requests)]


class Target(msgspec.Struct, frozen=True):
    """A contender as the client sees it: its URL, the model name it serves, and whether the class
    goes in the body's `priority` (a plain OpenAI server) besides the `x-slo-class` header."""

    url: str
    model: str
    priority_order: str | None = None  # lower_first (vLLM) | higher_first | None: send no priority


def model_name(url: str) -> str:
    """The first model the server lists (what every OpenAI server wants in `model`)."""
    r = httpx.get(f"{url}/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def _body(target: Target, a: Arrival, max_tokens: int, priorities: dict[str, int]) -> bytes:
    body: dict[str, Any] = {"model": target.model, "prompt": a.prompt, "max_tokens": max_tokens, "stream": True,
                            "temperature": 0, "ignore_eos": True}
    if target.priority_order is not None:
        body["priority"] = priorities[a.slo_class]
    return msgspec.json.encode(body)


async def sse_data(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream. Lines end at b"\n" only: httpx's
    aiter_lines splits like str.splitlines, so a generated U+0085 or U+2028 (which JSON leaves
    unescaped) would cut an event in two."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:].rstrip(b"\r")


def request_id(index: int) -> str:
    """The x-request-id an arrival is sent with: unique to this send, its index in the schedule last."""
    return f"peer-{time.time_ns()}-{index}"


def arrival_index(rid: str) -> int | None:
    """The schedule index a `request_id` names (None: not one this client sent)."""
    head, _, index = rid.rpartition("-")
    return int(index) if head.startswith("peer-") and index.isdigit() else None


async def _send(client: httpx.AsyncClient, url: str, body: bytes, rec: Record, ttft_ms: float | None) -> None:
    headers = {"content-type": "application/json", SLO_CLASS_HEADER: rec.slo_class,
               "x-request-id": request_id(rec.index)}
    if ttft_ms is not None:  # scaled targets: a server that reads SLO headers gets the target measured against
        headers[SLO_TTFT_HEADER] = f"{ttft_ms:g}"
    t_send = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", content=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return
            async for data in sse_data(resp):
                if data == b"[DONE]":
                    rec.e2e_s = time.perf_counter() - t_send
                    return
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"stream error: {event['error'].get('message', '')}"
                    return
                if event.get("choices") and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - t_send
            rec.error = "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        rec.error = "unanswered when the drain time ran out"
        raise


async def replay(target: Target, schedule: list[Arrival], max_tokens: int = 1, drain_s: float = 60.0,
                 at: list[tuple[float, Callable[[], None]]] | None = None,
                 classes: Mapping[str, SLOClass] | None = None) -> list[Record]:
    """Send `schedule` to `target` open loop and wait for every answer (at most `drain_s` after the
    last arrival; what is left then is cancelled, counted as failed). `at`: (seconds from the start,
    callback) run on the way, e.g. switching a busy process on halfway. `classes`: targets other than
    the defaults (scaled), sent with each request as its explicit TTFT target."""
    priorities = class_priorities(target.priority_order or "lower_first")
    bodies = [_body(target, a, max_tokens, priorities) for a in schedule]
    records = [Record(index=a.index, slo_class=a.slo_class, input_tokens=a.input_tokens, scheduled_s=a.due_s)
               for a in schedule]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        handles = [loop.call_at(t0 + s, cb) for s, cb in at or []]
        tasks = []
        for a, body, rec in zip(schedule, bodies, records, strict=True):
            if (delay := t0 + a.due_s - loop.time()) > 0:
                await asyncio.sleep(delay)
            rec.lag_s = max(0.0, loop.time() - (t0 + a.due_s))
            ttft_ms = classes[a.slo_class].ttft_ms if classes is not None else None
            tasks.append(asyncio.create_task(_send(client, target.url, body, rec, ttft_ms)))
        _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for h in handles:
            h.cancel()
    return records


def ttft_target_s(slo_class: str, classes: Mapping[str, SLOClass] = DEFAULT_CLASSES) -> float:
    return classes[slo_class].ttft_ms / 1000
