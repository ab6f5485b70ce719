"""Late requests on a real engine and worker: a `late = "shed"` class's request that turns hopeless while
queued is refused as at admission (429, Retry-After, the reason); a `serve` class's is served."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import EngineFactory
from test_engine import Sink

from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.protocol.slo import DEFAULT_CLASSES, SHED_ERROR, SHED_REASON, SLOClass
from engine.serving.worker import create_worker_app

BULK = SLOClass("bulk", ttft_ms=300, tbt_ms=100, priority=0, sheddable=True, late="shed")
SLOW = SLOClass("slow", ttft_ms=300, tbt_ms=100, priority=0, sheddable=True)  # late = "serve"


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch)
    yield factory
    factory.close()


def engine_with_a_clock(factory: EngineFactory) -> tuple[Engine, list[float]]:
    """An engine not started yet, whose clock runs `offset[0]` seconds ahead of the real one."""
    eng = factory(start=False)
    offset = [0.0]
    eng.clock = eng.scheduler.clock = lambda: time.monotonic() + offset[0]
    return eng, offset


def queued_then_late(factory: EngineFactory, cls: SLOClass) -> httpx.Response:
    """An interactive request holds the engine (its deadline is first); a request of `cls` queues
    behind it; then ten seconds pass before the engine runs at all: at the next decision the queued
    request can no longer meet its 300 ms target."""
    eng, offset = engine_with_a_clock(factory)
    app = create_worker_app(eng, "m", classes=DEFAULT_CLASSES | {cls.name: cls})
    blocker = Request.for_class(DEFAULT_CLASSES["interactive"], request_id="blocker", prompt_token_ids=[65] * 200,
                                sampling=SamplingParams(max_tokens=1))
    blocker.sink = Sink(blocker)
    eng.add_request(blocker)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            sent = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                              headers={"x-slo-class": cls.name}))
            while len(eng._inbox) < 2 and not sent.done():  # the blocker's arrival, then this request's
                await asyncio.sleep(0.005)
            eng._take_inbox()  # not started: this thread takes the arrivals, as the engine thread would
            assert eng.scheduler.chosen.requests == [blocker]  # admitted, and queued behind it
            offset[0] = 10.0
            eng.start()
            return await sent

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_a_request_of_a_shed_class_that_turns_hopeless_in_the_queue_gets_429(make_engine: EngineFactory) -> None:
    r = queued_then_late(make_engine, BULK)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1" and r.headers["x-flowprefill-dropped-reason"] == SHED_REASON
    assert r.json()["error"] == {"message": SHED_ERROR, "type": "rate_limit_exceeded", "param": None,
                                 "code": SHED_REASON}
    eng = make_engine.engines[-1]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks or eng.num_decoding  # nothing held for it


def test_a_request_of_a_serve_class_is_served_late(make_engine: EngineFactory) -> None:
    r = queued_then_late(make_engine, SLOW)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None


def test_late_policies_in_the_gateway_toml(tmp_path) -> None:
    from gateway.config import GatewayConfig

    good = tmp_path / "good.toml"
    good.write_text('[classes.batch]\nlate = "shed"\n\n[classes.interactive]\nlate_ms = 300\n')
    cfg = GatewayConfig.load(good)
    assert cfg.classes["batch"].late == "shed" and cfg.classes["batch"].sheddable
    assert cfg.classes["interactive"].late_bound_ms == 300 and cfg.classes["standard"].late_bound_ms == 1000
    r = Request.for_class(cfg.classes["batch"], request_id="b", prompt_token_ids=[1])
    assert r.shed_late and r.bound == pytest.approx(r.deadline + 12.0)
    bad = tmp_path / "bad.toml"
    bad.write_text('[classes.interactive]\nlate = "shed"\n')  # not sheddable
    with pytest.raises(ValueError, match="sheddable"):
        GatewayConfig.load(bad)
    bad.write_text('[classes.standard]\nlate = "drop"\n')
    with pytest.raises(ValueError, match="late"):
        GatewayConfig.load(bad)
