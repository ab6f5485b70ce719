"""The gateway's slack in front of plain OpenAI servers (gateway/late.py `ServiceTimes`): a waiter's
latest start is its deadline less the time to first token seen for prompts of its size, waiters go in
that order, and one whose latest start has passed is late (served by its bound, or shed) before its
deadline itself has passed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from processes import free_port, start, stop, wait_healthy
from test_upstream import StreamingOpenAI

from gateway.config import Upstream
from gateway.late import Lateness, LateShed, ServiceTimes
from telemetry.metrics import GatewayMetrics

pytestmark = pytest.mark.gateway_only


def test_service_times_are_a_low_quantile_per_prompt_size() -> None:
    times = ServiceTimes()
    for _ in range(ServiceTimes.MIN_SEEN - 1):
        times.observe(100, 0.2)
    assert times.estimate(100) == 0.0  # too few answers of its size: no cost, plain deadlines
    times.observe(100, 0.2)
    assert times.estimate(100) == pytest.approx(0.2)
    for seconds in (0.05, 0.06, 0.07, 1.0, 2.0, 3.0, 4.0, 5.0):  # 16 in all: the quarter-way one is 0.2
        times.observe(90, seconds)
    assert times.estimate(100) == pytest.approx(0.2)
    assert times.estimate(4000) == pytest.approx(0.2)  # unseen size: the shorter sizes' largest estimate
    assert times.estimate(10) == 0.0  # shorter than anything seen: nothing to go by
    for _ in range(ServiceTimes.WINDOW):  # a faster server: the window forgets the old answers
        times.observe(100, 0.01)
    assert times.estimate(100) == pytest.approx(0.01)
    for _ in range(ServiceTimes.MIN_SEEN):
        times.observe(3000, 0.9)
        times.observe(1000, 0.5)
        times.observe(0, 9.0)  # a prompt of no countable tokens (an image only): not a size
    assert times.estimate(4000) == pytest.approx(0.9) and times.estimate(200) == pytest.approx(0.01)
    assert times.estimate(2000) == pytest.approx(0.5)  # its own answers: none yet, the shorter sizes' largest
    for _ in range(ServiceTimes.MIN_SEEN):  # size 1,024-2,047: what it was seen to take, not the shorter ones'

        times.observe(1500, 0.2)
    assert times.estimate(2000) == pytest.approx(0.2) and times.estimate(1) == 0.0


@pytest.mark.parametrize("slack", ["observed", "deadline"])
def test_a_waiter_whose_latest_start_passed_is_late_before_its_deadline(slack: str) -> None:
    """A slot in use for 1.5 s; behind it, prompts of 1,000 tokens, whose first token has come 1 s after
    dispatch. Waiter A (deadline in 2.2 s) must start by 1.2 s: when the slot frees at 1.5 s it is
    hopeless, so B (deadline 3.5 s, latest start 2.5 s) goes first and A goes by its late bound; a
    sheddable C of A's deadline is refused. With `slack = "deadline"` A goes first, as plain EDF would.
    (Each side of every comparison has 0.3 s or more to spare for a slow machine.)"""
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(["http://a"], client, upstream=Upstream(kind="openai", max_concurrency=1, slack=slack))
            for _ in range(ServiceTimes.MIN_SEEN):
                pool.first_token(1000, 1.0)
            now = time.monotonic()
            held = await pool.acquire(now + 10)
            a = asyncio.ensure_future(pool.acquire(now + 2.2, late=Lateness(5.0, False), prompt_tokens=1000))
            c = asyncio.ensure_future(pool.acquire(now + 2.2, late=Lateness(5.0, True), prompt_tokens=1000))
            b = asyncio.ensure_future(pool.acquire(now + 3.5, late=Lateness(5.0, False), prompt_tokens=1000))
            await asyncio.sleep(max(0.0, now + 1.5 - time.monotonic()))
            pool.release(held)
            first = await asyncio.wait_for(b if slack == "observed" else a, 1)
            assert not (a if slack == "observed" else b).done()
            if slack == "observed":
                with pytest.raises(LateShed):
                    await c
                assert pool.late.shed == 1 and pool.late.late == 1
                metrics = GatewayMetrics()
                metrics.track_pools({"workers": pool})
                text = metrics.render().decode()  # what an operator sees of it
                assert 'flowprefill_gateway_late_total{outcome="served_late",pool="workers"} 1.0' in text
                assert 'flowprefill_gateway_late_total{outcome="shed",pool="workers"} 1.0' in text
                assert 'flowprefill_gateway_first_token_estimate_seconds{pool="workers",prompt_tokens_le="1023"} 1.0' \
                    in text
            pool.release(first)
            while pending := [f for f in (a, b, c) if not f.done()]:  # the rest, one at a time
                done, _ = await asyncio.wait(pending, timeout=1, return_when=asyncio.FIRST_COMPLETED)
                assert len(done) == 1
                pool.release(done.pop().result())

    asyncio.run(asyncio.wait_for(main(), 10))


def test_through_the_gateway_a_shed_class_is_refused_once_its_deadline_is_out_of_reach(tmp_path: Path) -> None:
    """The real gateway in front of a streaming server whose first token comes after 0.5 s: once it
    has seen that, a request of a sheddable class with a 0.7 s target that waits about 0.45 s behind
    another cannot make it (its latest start passed about 0.25 s before the slot frees) and is refused
    with 429 then, where plain EDF would have sent it to be answered late (its deadline is still 0.25 s
    away then); `--slack deadline` sends it."""
    from processes import uvicorn_thread

    cfg = tmp_path / "gw.toml"
    cfg.write_text('[upstream]\nkind = "openai"\nmax_concurrency = 1\n'
                   '[classes.hasty]\nttft_ms = 700\ntbt_ms = 100\npriority = 9\nsheddable = true\nlate = "shed"\n')
    codes = {}
    with uvicorn_thread(StreamingOpenAI(prefill_s=0.5, hold_s=0.0)) as up_port:
        for slack in ("observed", "deadline"):
            port = free_port()
            gw = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(port), "--config",
                       str(cfg), "--slack", slack)
            try:
                wait_healthy(f"http://127.0.0.1:{port}", gw)
                codes[slack] = asyncio.run(_seen_then_queued(port))
            finally:
                stop(gw)
    assert codes == {"observed": (200, 429), "deadline": (200, 200)}


async def _seen_then_queued(port: int) -> tuple[int, int]:
    """Eight streamed requests one by one (the gateway sees 0.5 s to first token), then two at once:
    the first's status and the one queued behind it."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        async def send(cls: str = "batch") -> int:
            r = await c.post("/v1/completions", headers={"x-slo-class": cls},
                             json={"prompt": list(range(50)), "max_tokens": 1, "stream": True})
            return r.status_code
        for _ in range(ServiceTimes.MIN_SEEN):
            assert await send() == 200
        first = asyncio.ensure_future(send())
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(send("hasty"))
        return await first, await queued


class RefusingOpenAI:
    """A plain OpenAI server that refuses every completion at once (400), as vLLM refuses a prompt past
    its context."""

    async def __call__(self, scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        status = 400 if scope["path"] == "/v1/completions" else 200
        await send({"type": "http.response.start", "status": status,  # type: ignore[operator]
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "too long"}}'})  # type: ignore[operator]


def test_a_refusal_is_not_a_time_to_first_token() -> None:
    """Streamed requests the server refuses at once say nothing of how long a prompt takes: the
    gateway's estimates stay empty (else their near-zero times would pull every estimate down)."""
    from processes import uvicorn_thread

    with uvicorn_thread(RefusingOpenAI()) as up_port:
        port = free_port()
        gw = start("gateway", "--workers", f"http://127.0.0.1:{up_port}", "--port", str(port), "--upstream", "openai")
        try:
            wait_healthy(f"http://127.0.0.1:{port}", gw)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                codes = {c.post("/v1/completions", json={"prompt": list(range(50)), "max_tokens": 1,
                                                         "stream": True}).status_code
                         for _ in range(ServiceTimes.MIN_SEEN + 2)}
                metrics = c.get("/metrics").text
        finally:
            stop(gw)
    assert codes == {400}
    assert "flowprefill_gateway_first_token_estimate_seconds{" not in metrics


@pytest.mark.parametrize("backfill", [True, False])
def test_a_short_waiter_backfills_room_a_longer_one_cannot_use_yet(backfill: bool) -> None:
    """A 1,000-token budget with 600 in flight; prompts of ~100 tokens have come back in 0.1 s. H (700
    tokens, latest start about 4.9 s away) does not fit and holds the server. B (100 tokens, behind it
    by latest start, streamed) fits the 400 left and is expected back long before H must start: it goes
    at once (EASY backfilling), in strict order (`backfill = false`) it waits; D, the same but not
    streamed (its tokens would come back at its end), waits either way. C (100 tokens) behind a holder
    that must start within 0.05 s would make it late, so it waits either way."""
    from gateway.routing import WorkerPool

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            upstream = Upstream(kind="openai", max_concurrency=8, max_tokens_in_flight=1000, reserve_tokens=0,
                                backfill=backfill)
            pool = WorkerPool(["http://a"], client, upstream=upstream)
            for _ in range(ServiceTimes.MIN_SEEN):
                pool.first_token(100, 0.1)
            now = time.monotonic()
            held = await pool.acquire(now + 60, tokens=600, prompt_tokens=600)
            h = asyncio.ensure_future(pool.acquire(now + 5, tokens=700, prompt_tokens=700, streamed=True))
            d = asyncio.ensure_future(pool.acquire(now + 20, tokens=100, prompt_tokens=100))  # not streamed
            b = asyncio.ensure_future(pool.acquire(now + 30, tokens=100, prompt_tokens=100, streamed=True))
            await asyncio.sleep(0.05)
            assert not h.done() and b.done() is backfill
            assert not d.done()  # it would hold its tokens to its answer's end, not its first token
            pool.release(held, 600)
            assert (await asyncio.wait_for(h, 1)) is held  # room for it now
            await asyncio.wait_for(d, 1)  # 700 + 100 fit
            pool.release(held, 100)
            if not backfill:
                await asyncio.wait_for(b, 1)
            pool.release(held, 700)
            pool.release(held, 100)
            held = await pool.acquire(now + 60, tokens=600, prompt_tokens=600)
            h = asyncio.ensure_future(pool.acquire(time.monotonic() + 0.15, tokens=700, prompt_tokens=700))
            c = asyncio.ensure_future(pool.acquire(now + 30, tokens=100, prompt_tokens=100, streamed=True))
            await asyncio.sleep(0.02)
            assert not h.done() and not c.done()  # C would still be in flight when H must start
            h.cancel()
            c.cancel()
            pool.release(held, 600)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_waiter_rekeyed_late_is_known_late_until_it_is_served() -> None:
    """`LateGate.is_late`: what backfilling reads, so that nothing is backfilled ahead of a holder that
    is late already (its key, its late bound, would otherwise read as time to spare)."""
    from gateway.late import LateGate

    async def main() -> None:
        gate = LateGate()
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        gate.track(fut, now + 0.1, Lateness(5.0, False))
        waiting = gate.rekey([(now + 0.05, 0, fut)], now)  # not yet due
        assert not gate.is_late(fut)
        waiting = gate.rekey(waiting, now + 0.06)
        assert gate.is_late(fut) and waiting[0][0] == pytest.approx(now + 5.1)
        fut.set_result("served")
        await asyncio.sleep(0)  # done callbacks run on the loop
        assert not gate.is_late(fut)

    asyncio.run(main())
