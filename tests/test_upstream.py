"""Generic upstream mode: the gateway in front of a plain OpenAI-compatible server, holding an EDF
queue with a concurrency cap so urgent requests overtake queued ones."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from processes import answers, free_port, needs_engine, start, stop, wait_healthy

from engine.protocol.slo import DEFAULT_CLASSES
from gateway.config import GatewayConfig, Upstream

pytestmark = pytest.mark.gateway_only


def test_priority_mapping() -> None:
    vllm = GatewayConfig(upstream=Upstream(kind="openai"))  # lower runs sooner
    assert [vllm.upstream_priority(c) for c in DEFAULT_CLASSES.values()] == [0, 1, 2, 3]
    sglang = GatewayConfig(upstream=Upstream(kind="openai", priority_order="higher_first"))
    assert [sglang.upstream_priority(c) for c in DEFAULT_CLASSES.values()] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="max_concurrency"):
        GatewayConfig(upstream=Upstream(max_concurrency=0)).check()


@pytest.fixture(scope="module")
def gated() -> Iterator[str]:
    """A plain OpenAI server (a flowprefill worker scheduling FCFS, addressed only through the OpenAI
    API and /health) behind `flowprefill gateway --upstream openai --max-concurrency 1`."""
    up_port, gw_port = free_port(), free_port()
    upstream = start("worker", "--model", "tiny", "--port", str(up_port), "--policy", "fcfs", "--threads", "1",
                     "--kv-capacity-tokens", "65536")
    gateway = None
    try:
        wait_healthy(f"http://127.0.0.1:{up_port}", upstream)
        gateway = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(gw_port),
                        "--upstream", "openai", "--max-concurrency", "1")
        wait_healthy(f"http://127.0.0.1:{gw_port}", gateway)
        yield f"http://127.0.0.1:{gw_port}"
    finally:
        if gateway is not None:
            stop(gateway)
        stop(upstream)


@needs_engine
def test_urgent_request_overtakes_queue(gated: str) -> None:
    async def main() -> dict[str, float]:
        done: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=gated, timeout=120) as c:
            async def send(rid: str, cls: str, n: int, delay: float) -> None:
                await asyncio.sleep(delay)
                r = await c.post("/v1/completions", headers={"x-slo-class": cls, "x-request-id": rid},
                                 json={"prompt": [65] * n, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.headers["x-slo-class"] == cls
                done[rid] = time.monotonic()

            # one long request holds the only slot; three batch requests queue; then an urgent one
            await asyncio.gather(send("long", "batch", 6000, 0), *(send(f"b{i}", "batch", 1500, 0.1 + i * 0.02)
                                 for i in range(3)), send("urgent", "interactive", 32, 0.3))
            metrics = (await c.get("/metrics")).text
        assert "flowprefill_gateway_requests_queued 0.0" in metrics
        return done

    done = asyncio.run(main())
    order = sorted(done, key=done.get)
    assert order[0] == "long" and order[1] == "urgent", order  # EDF at the gateway: it overtook b0..b2


def test_no_healthy_upstream(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[upstream]\nkind = "openai"\nmax_concurrency = 1\nmax_queue = 0\n')
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start("gateway", "--workers", dead, "--port", str(port), "--config", str(cfg))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", gw, ready=answers)  # up, with no healthy worker
        health = httpx.get(f"http://127.0.0.1:{port}/health")
        assert health.status_code == 503 and health.json()["reason"] == "no healthy worker"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.headers["x-flowprefill-dropped-reason"] == "no_healthy_worker"
        assert r.json()["error"]["type"] == "server_error"
    finally:
        stop(gw)


def test_edf_gate_order_bound_and_cancel() -> None:
    from gateway.routing import QueueFull, WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a", "http://b"], client,
                              upstream=Upstream(kind="openai", max_concurrency=1, max_queue=3))
            a, b = await pool.acquire(10.0), await pool.acquire(10.0)
            assert {a.url, b.url} == {"http://a", "http://b"}  # one per server, up to the cap
            late = asyncio.ensure_future(pool.acquire(9.0))
            urgent = asyncio.ensure_future(pool.acquire(1.0))
            gone = asyncio.ensure_future(pool.acquire(0.5))
            await asyncio.sleep(0)
            with pytest.raises(QueueFull):
                await pool.acquire(5.0)
            gone.cancel()  # the client went away while queued: it leaves the queue
            await asyncio.sleep(0)
            pool.release(a)
            assert (await urgent).url == a.url and not late.done()  # earliest deadline first
            pool.release(b)
            assert (await late).url == b.url and pool.queued == 0

    asyncio.run(main())


@needs_engine
def test_other_endpoints_are_forwarded_as_they_are(gated: str) -> None:
    """In front of a plain OpenAI server (vLLM has them all): the Responses API queued and classed
    like chat, tokenize and detokenize as they are, one model found in the server's list."""
    r = httpx.post(f"{gated}/v1/responses", headers={"x-llm-d-inference-objective": "batch"},
                   json={"input": "hi", "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-slo-class"] == "batch" and r.json()["object"] == "response"
    ids = httpx.post(f"{gated}/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert httpx.post(f"{gated}/detokenize", json={"tokens": ids}).json() == {"prompt": "hello"}
    (listed,) = httpx.get(f"{gated}/v1/models").json()["data"]
    assert httpx.get(f"{gated}/v1/models/{listed['id']}").json() == listed
    missing = httpx.get(f"{gated}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_late_waiters_go_by_their_bound_or_are_shed() -> None:
    """Plain EDF would hand the slot to the waiter whose deadline already passed (and under overload
    make every next one late too); the gate serves the one still on time first, the late one by its
    late bound, and sheds a late waiter of a `late = "shed"` class (gateway/late.py)."""
    from gateway.late import Lateness, LateShed
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a"], client, upstream=Upstream(kind="openai", max_concurrency=1))
            now = time.monotonic()
            held = await pool.acquire(now + 10)
            late = asyncio.ensure_future(pool.acquire(now - 0.1, late=Lateness(bound_s=1.0, shed=False)))
            on_time = asyncio.ensure_future(pool.acquire(now + 0.5, late=Lateness(bound_s=1.0, shed=False)))
            shed = asyncio.ensure_future(pool.acquire(now - 0.1, late=Lateness(bound_s=1.0, shed=True)))
            overdue = asyncio.ensure_future(pool.acquire(now + 0.95, late=Lateness(bound_s=0.0, shed=False)))
            await asyncio.sleep(0)
            pool.release(held)
            assert (await on_time).url == "http://a" and not late.done()  # on time first: 0.5 s < 0.9 s
            with pytest.raises(LateShed):
                await shed
            pool.release(await on_time)
            assert (await late).url == "http://a" and not overdue.done()  # its bound, 0.9 s, before 0.95 s
            fresh = asyncio.ensure_future(pool.acquire(now + 1.5))  # on time throughout
            await asyncio.sleep(max(0.0, now + 1.0 - time.monotonic()))
            pool.release(await late)  # overdue is past its deadline with a bound of 0: before `fresh`
            assert (await overdue).url == "http://a" and not fresh.done()
            pool.release(await overdue)
            assert (await fresh).url == "http://a"
            assert pool.late.late == 2 and pool.late.shed == 1 and pool.queued == 0

    asyncio.run(asyncio.wait_for(main(), 10))


class SlowOpenAI:
    """A plain OpenAI server whose every completion takes `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def __call__(self, scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/completions":
            await asyncio.sleep(self.delay_s)
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"choices": [{"text": "a", "index": 0}]}'})  # type: ignore[operator]


def test_a_sheddable_request_late_at_the_gateway_gets_429(tmp_path: Path) -> None:
    """Through the real gateway: the only slot is busy for 0.6 s; a request of a class with a 100 ms
    target and `late = "shed"` waits past its deadline and is refused with 429, Retry-After and the
    reason, without reaching the server; one of the same target that is served late gets its answer."""
    from processes import uvicorn_thread

    cfg = tmp_path / "gw.toml"
    cfg.write_text('[upstream]\nkind = "openai"\nmax_concurrency = 1\n'
                   '[classes.hasty]\nttft_ms = 100\ntbt_ms = 100\npriority = 9\nsheddable = true\nlate = "shed"\n'
                   '[classes.patient]\nttft_ms = 100\ntbt_ms = 100\npriority = 9\n')
    with uvicorn_thread(SlowOpenAI(0.6)) as up_port:
        port = free_port()
        gw = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(port), "--config", str(cfg))
        try:
            wait_healthy(f"http://127.0.0.1:{port}", gw)

            async def main() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                    async def send(cls: str, delay: float) -> httpx.Response:
                        await asyncio.sleep(delay)
                        return await c.post("/v1/completions", headers={"x-slo-class": cls},
                                            json={"prompt": "hi", "max_tokens": 1})
                    return await asyncio.gather(send("batch", 0), send("hasty", 0.2), send("patient", 0.2))

            first, hasty, patient = asyncio.run(main())
        finally:
            stop(gw)
    assert first.status_code == 200 and patient.status_code == 200
    assert hasty.status_code == 429, hasty.text
    assert hasty.headers["x-flowprefill-dropped-reason"] == "predicted_slo_miss" and hasty.headers["retry-after"]
    assert "could no longer be met while it waited at the gateway" in hasty.json()["error"]["message"]


def test_a_token_budget_fills_the_servers_step_in_deadline_order() -> None:
    """`max_tokens_in_flight`: requests are admitted while their prompts fit the server's budget (a
    prompt longer than it counts as the whole budget and goes once the others' prompts are done);
    the earliest deadline first, and a waiter too long for the room left holds later ones back."""
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a"], client, upstream=Upstream(kind="openai", max_concurrency=64,
                                                                      max_tokens_in_flight=2048, reserve_tokens=0))
            assert [pool.charge(n) for n in (0, 700, 5000)] == [1, 700, 2048]
            a, b = await pool.acquire(10.0, tokens=700), await pool.acquire(10.0, tokens=700)
            long = asyncio.ensure_future(pool.acquire(5.0, tokens=pool.charge(5000)))
            short = asyncio.ensure_future(pool.acquire(8.0, tokens=100))  # fits, but after the long one
            urgent = asyncio.ensure_future(pool.acquire(1.0, tokens=600))  # fits and is first: in at once
            await asyncio.sleep(0)
            assert urgent.done() and not long.done() and not short.done()
            assert a.tokens_in_flight == 2000 and a.in_flight == 3
            pool.prefilled(a, 700)  # a's first token: its prompt is done, its request still decodes
            pool.release(b, 700)
            await asyncio.sleep(0)
            assert not long.done()  # the urgent one's 600 tokens are still in prefill
            pool.release(await urgent, 600)
            assert (await long).tokens_in_flight == 2048 and not short.done()  # alone, beside a decoding one
            pool.release(a)
            pool.prefilled(await long, 2048)
            assert (await short).tokens_in_flight == 100 and pool.queued == 0

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_long_prompt_leaves_a_reserve_to_shorter_ones() -> None:
    """By default a prompt longer than the budget less a quarter counts as that: a short urgent prompt
    still goes in beside it (joining its last chunk at the server), a longer one waits; reserve 0 is
    the whole budget, and a reserve as large as the budget is refused."""
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a"], client,
                              upstream=Upstream(kind="openai", max_concurrency=64, max_tokens_in_flight=2048))
            assert [pool.charge(n) for n in (700, 1536, 1800, 5000)] == [700, 1536, 1536, 1536]
            w = await pool.acquire(10.0, tokens=pool.charge(5000))
            short = await asyncio.wait_for(pool.acquire(1.0, tokens=pool.charge(400)), 1)
            assert short is w and w.tokens_in_flight == 1936
            wider = asyncio.ensure_future(pool.acquire(2.0, tokens=pool.charge(600)))
            await asyncio.sleep(0)
            assert not wider.done()  # 2,536 would be past the budget
            pool.prefilled(w, 1536)
            assert (await wider).tokens_in_flight == 1000

    asyncio.run(asyncio.wait_for(main(), 10))
    assert Upstream(kind="openai", max_tokens_in_flight=2048, reserve_tokens=100).long_prompt_charge == 1948
    for bad in (2048, -2):
        with pytest.raises(ValueError, match="reserve_tokens"):
            GatewayConfig(upstream=Upstream(kind="openai", max_tokens_in_flight=2048, reserve_tokens=bad)).check()


def test_without_a_token_budget_nothing_is_charged() -> None:
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            counted = WorkerPool(["http://a"], client, upstream=Upstream(kind="openai"))
            ours = WorkerPool(["http://a"], client, upstream=Upstream(max_tokens_in_flight=2048))
            assert counted.charge(5000) == 0 and ours.charge(5000) == 0  # engine workers schedule themselves

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_tokens_in_flight"):
        GatewayConfig(upstream=Upstream(kind="openai", max_tokens_in_flight=-1)).check()


class StreamingOpenAI:
    """A plain OpenAI server that streams a first token after `prefill_s`, then holds the stream
    `hold_s` before it ends; it keeps the time each completion arrived."""

    def __init__(self, prefill_s: float, hold_s: float) -> None:
        self.prefill_s, self.hold_s, self.arrivals = prefill_s, hold_s, list[float]()

    async def __call__(self, scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
            await send({"type": "http.response.body", "body": b"{}"})  # type: ignore[operator]
            return
        self.arrivals.append(time.monotonic())
        await asyncio.sleep(self.prefill_s)
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-type", b"text/event-stream")]})
        chunk = b'data: {"choices": [{"text": "a", "index": 0, "finish_reason": null}]}\n\n'
        await send({"type": "http.response.body", "body": chunk, "more_body": True})  # type: ignore[operator]
        await asyncio.sleep(self.hold_s)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})  # type: ignore[operator]


@pytest.mark.parametrize("budget", [100, 0])
def test_a_streamed_request_gives_its_tokens_back_at_its_first_token(budget: int) -> None:
    """Through the real gateway (`--max-tokens-in-flight 100`, 8 requests in flight): two streamed
    requests of 80 prompt token ids each, the server's first token after 0.5 s, its end 1.5 s later.
    The second reaches the server once the first's first token is back, not when its stream ends;
    without a budget both go at once."""
    from processes import uvicorn_thread

    server = StreamingOpenAI(prefill_s=0.5, hold_s=1.5)
    with uvicorn_thread(server) as up_port:
        port = free_port()
        gw = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(port), "--upstream",
                   "openai", "--max-concurrency", "8", "--max-tokens-in-flight", str(budget))
        try:
            wait_healthy(f"http://127.0.0.1:{port}", gw)

            async def main() -> list[str]:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                    async def send() -> str:
                        r = await c.post("/v1/completions", json={"prompt": list(range(80)), "max_tokens": 4,
                                                                  "stream": True})
                        return r.text
                    return await asyncio.gather(send(), send())

            answers = asyncio.run(main())
        finally:
            stop(gw)
    assert all(a.endswith("data: [DONE]\n\n") for a in answers)
    first, second = server.arrivals
    if budget:
        assert 0.5 <= second - first < 1.5  # (2 s had it waited for the first's stream to end)
    else:
        assert second - first < 0.4


def test_a_long_waiter_holds_only_the_workers_it_may_use() -> None:
    """Two servers, 100 prompt tokens each, 90 in prefill on both. The head waiter needs the whole
    budget and may not go to b (it failed there before): it holds a alone, and a short prompt
    behind it still gets b's room; one that would fit a only waits with it."""
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a", "http://b"], client,
                              upstream=Upstream(kind="openai", max_concurrency=8, max_tokens_in_flight=100))
            first, second = await pool.acquire(10.0, tokens=90), await pool.acquire(10.0, tokens=90)
            a = first if first.url == "http://a" else second
            b = second if a is first else first
            head = asyncio.ensure_future(pool.acquire(1.0, frozenset({"http://b"}), tokens=100))
            wants_a = asyncio.ensure_future(pool.acquire(2.0, frozenset({"http://b"}), tokens=10))
            short = asyncio.ensure_future(pool.acquire(3.0, tokens=10))
            await asyncio.sleep(0)
            assert (await short) is b and not head.done() and not wants_a.done()
            pool.prefilled(a, 90)
            assert (await head) is a and not wants_a.done()  # in order: the head first, then the rest
            pool.release(a, 100)
            assert (await wants_a) is a

    asyncio.run(asyncio.wait_for(main(), 10))


def test_prompt_tokens_are_estimated_from_text_parts_too() -> None:
    from gateway.classify import estimate_prompt_tokens

    parts = {"messages": [{"role": "system", "content": "x" * 40},
                          {"role": "user", "content": [{"type": "text", "text": "y" * 400}, {"type": "image_url"}]}]}
    assert estimate_prompt_tokens(parts) == 110 and estimate_prompt_tokens({"prompt": list(range(7))}) == 7


def test_metrics_show_what_is_in_flight_per_pool() -> None:
    """`flowprefill_gateway_in_flight{pool, unit}`: requests and prompt tokens held at the workers,
    read at each scrape (a leak in the token accounting would show here as a floor above 0)."""
    from gateway.routing import WorkerPool
    from telemetry.metrics import GatewayMetrics

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a", "http://b"], client,
                              upstream=Upstream(kind="openai", max_tokens_in_flight=100))
            metrics = GatewayMetrics()
            metrics.track_pools({"workers": pool, "prefill_workers": None})
            w = await pool.acquire(1.0, tokens=60)
            await pool.acquire(1.0, tokens=30)
            text = metrics.render().decode()
            assert 'flowprefill_gateway_in_flight{pool="workers",unit="requests"} 2.0' in text
            assert 'flowprefill_gateway_in_flight{pool="workers",unit="prompt_tokens"} 90.0' in text
            pool.prefilled(w, 60)
            assert 'unit="prompt_tokens"} 30.0' in metrics.render().decode()

    asyncio.run(main())
