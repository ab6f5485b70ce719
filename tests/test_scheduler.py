"""Scheduler and policies on a fake clock: no model, virtual batches (the simulator's)."""

from __future__ import annotations

import copy

import pytest

from engine.core.config import ModelConfig
from engine.core.kv_cache import BlockPool
from engine.core.prefill import PrefillBatch
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler, make_policy
from engine.model.cost import OpCost, SeqSpan
from engine.model.plan import plan_prefill
from engine.protocol.slo import DEFAULT_CLASSES
from engine.sim.simulator import VirtualRun

COST = OpCost(ModelConfig(), attn_in_s_per_row=2e-6, ffn_s_per_row=1.2e-5, attn_s_per_pair=7e-8)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(policy: str, max_batch_tokens: int = 2048, kv_tokens: int = 1 << 20):
    clock = FakeClock()
    pool = BlockPool(256, kv_tokens)

    def make_batch(reqs: list[Request], spans: list[SeqSpan]) -> PrefillBatch:
        for r in reqs:
            if not r.block_table:
                r.block_table = pool.allocate(r.max_total_tokens)
        steps = plan_prefill(COST, spans, 0.002)
        return PrefillBatch(reqs, spans, steps, VirtualRun(len(steps)))

    return Scheduler(make_policy(policy), make_batch, COST, pool, max_batch_tokens, clock), clock, pool


def req(rid: str, n: int, cls: str, at: float) -> Request:
    return Request.for_class(DEFAULT_CLASSES[cls], request_id=rid, prompt_token_ids=[1] * n,
                             sampling=SamplingParams(max_tokens=1), arrival_time=at)


def test_flowprefill_preempts_long_batch_for_urgent_request() -> None:
    s, clock, _ = make_scheduler("flowprefill")
    long = req("long", 8000, "batch", 0.0)
    s.on_arrival(long)
    first = s.chosen
    assert first is not None and first.requests == [long]
    first.advance()
    clock.t = 0.1
    short = req("short", 200, "interactive", 0.1)
    s.on_arrival(short)
    assert s.chosen is not first and s.chosen.requests == [short]  # preemption decided at the event
    assert first in s.pool  # suspended, not dropped
    s.on_completion(s.chosen)
    assert s.chosen is first  # resumed where it stopped
    assert first.next_step == 1


def test_fcfs_never_preempts() -> None:
    s, clock, _ = make_scheduler("fcfs")
    s.on_arrival(req("long", 8000, "batch", 0.0))
    first = s.chosen
    clock.t = 0.1
    s.on_arrival(req("short", 200, "interactive", 0.1))
    assert s.chosen is first


def test_sedf_orders_feasible_by_deadline_then_hopeless() -> None:
    s, _, _ = make_scheduler("flowprefill", max_batch_tokens=1)  # one request per batch
    # Block the engine with a running batch, then queue three more.
    s.on_arrival(req("running", 100, "batch", 0.0))
    running = s.chosen
    hopeless = req("hopeless", 16000, "interactive", 0.0)  # cannot finish 16K tokens in 250 ms
    late = req("late", 100, "relaxed", 0.0)
    soon = req("soon", 100, "standard", 0.0)
    for r in (hopeless, late, soon):
        s.on_arrival(r)
    assert hopeless.predicted_miss and not (late.predicted_miss or soon.predicted_miss)  # flagged at arrival
    order = []
    batch = s.chosen
    while batch is not None:
        order.append(batch.head.request_id)
        s.on_completion(batch)
        batch = s.chosen
    assert running.head.request_id == "running"
    # The running batch (deadline 6 s) is preempted by both feasible requests with earlier
    # deadlines; the hopeless one runs last although its deadline is the earliest of all.
    assert order == ["soon", "late", "running", "hopeless"]


def test_batching_respects_token_bound_and_slack() -> None:
    s, _, _ = make_scheduler("flowprefill", max_batch_tokens=1000)
    s.on_arrival(req("busy", 8000, "batch", 0.0))  # occupy
    reqs = [req(f"r{i}", 400, "relaxed", 0.0) for i in range(4)]
    for r in reqs:
        s.on_arrival(r)
    busy = s.chosen
    s.on_completion(busy)
    assert sum(r.num_prompt_tokens for r in s.chosen.requests) <= 1000
    assert len(s.chosen.requests) == 2
    # A tight head: nothing joins that would make it miss (guard 0.1 x TTFT).
    s2, _, _ = make_scheduler("flowprefill", max_batch_tokens=100_000)
    s2.on_arrival(req("busy", 8000, "batch", 0.0))
    head = req("head", 1500, "interactive", 0.0)
    s2.on_arrival(head)
    s2.on_arrival(req("big", 6000, "relaxed", 0.0))
    assert s2.chosen.requests == [head]


def test_chunked_switches_only_at_chunk_boundaries_and_fills_budget() -> None:
    s, clock, _ = make_scheduler("chunked:2048")
    long = req("long", 5000, "batch", 0.0)
    s.on_arrival(long)
    first = s.chosen
    assert [sp.length for sp in first.spans] == [2048]
    clock.t = 0.01
    short = req("short", 100, "interactive", 0.01)
    s.on_arrival(short)
    assert s.chosen is first  # no switch inside a chunk
    long.num_computed_tokens = 2048
    s.on_completion(first, [long])
    nxt = s.chosen
    assert nxt.requests[0] is short  # S-EDF: the urgent request leads the next chunk batch
    assert [sp.length for sp in nxt.spans] == [100, 1948]  # filled to the chunk budget
    assert nxt.spans[1].start == 2048


def test_scheduler_runs_once_per_event_only() -> None:
    s, _, _ = make_scheduler("flowprefill")
    s.on_arrival(req("a", 3000, "batch", 0.0))
    batch = s.chosen
    for _ in range(5):  # executing steps never calls the scheduler
        batch.advance()
    assert s.invocations == 1
    s.on_arrival(req("b", 100, "interactive", 0.0))
    assert s.invocations == 2
    s.on_cancel(s.waiting[0] if s.waiting else s.chosen.head)
    assert s.invocations == 3


def test_kv_capacity_holds_requests_back_without_losing_them() -> None:
    s, _, pool = make_scheduler("fcfs", kv_tokens=4096)
    a, b = req("a", 3000, "batch", 0.0), req("b", 3000, "batch", 0.0)
    s.on_arrival(a)
    s.on_arrival(b)
    assert s.chosen.requests == [a] and b in s.waiting
    pool.free(a.block_table)
    s.on_completion(s.chosen)
    assert s.chosen.requests == [b]


@pytest.mark.parametrize("name", ["flowprefill", "fcfs", "chunked:512", "chunked:512:fcfs", "edf", "priority"])
def test_every_policy_finishes_every_request(name: str) -> None:
    from engine.sim import SimConfig, simulate

    reqs = [req(f"r{i}", n, c, t) for i, (n, c, t) in
            enumerate([(8000, "batch", 0.0), (100, "interactive", 0.05), (3000, "relaxed", 0.06),
                       (1500, "standard", 0.2), (50, "interactive", 0.21)])]
    simulate(reqs, make_policy(name), COST, SimConfig())
    assert all(r.times.first_token_time is not None for r in reqs)


def test_bad_policy_names_rejected() -> None:
    for bad in ("nope", "chunked", "chunked:x", "chunked:0"):
        with pytest.raises(ValueError):
            make_policy(bad)


def _stream_with_a_long_request(late_share: float) -> tuple[Request, list[Request]]:
    """A 3000-token batch request (6 s target) while 200-token interactive requests keep arriving for
    60 s, enough to keep the engine 97 % busy on their own."""
    from engine.sim import SimConfig, simulate

    alone = req("alone", 200, "interactive", 0.0)
    simulate([alone], make_policy("flowprefill"), COST, SimConfig())
    short_s = alone.ttft  # what one takes
    long = req("long", 3000, "batch", 0.0)
    stream = [req(f"i{i}", 200, "interactive", 0.01 + i * short_s / 0.97) for i in range(int(60 * 0.97 / short_s))]
    simulate([long, *stream], make_policy("flowprefill"), COST, SimConfig(late_share=late_share))
    return long, stream


def test_a_late_request_is_served_within_its_bound_while_urgent_ones_keep_arriving() -> None:
    """The paper's S-EDF (no late share) leaves the long request until the stream ends; the late tier
    serves it by its bound (6 s target + 12 s late_ms), and the stream still makes its targets."""
    starved, _ = _stream_with_a_long_request(late_share=0.0)
    assert starved.ttft > 30  # what issue 25 saw: long prompts served tens of seconds late
    long, stream = _stream_with_a_long_request(late_share=0.5)
    long_s = COST.prefill_s([SeqSpan(0, 3000)])
    # By its bound, give or take its own prefill at the late tier's share (brief lost requests of the
    # stream go first in the late turns: 18.7 s before they did, 19.4 s since)
    assert long.ttft <= long.ttft_target_s + long.late_s + long_s / 0.5
    assert long.ttft > long.ttft_target_s  # it was late: the stream had the engine first
    # the price: the stream falls behind by the long prefill and catches up on its 3 % of spare time
    assert sum(r.ttft <= r.ttft_target_s for r in stream) / len(stream) > 0.9
    # and none of the stream is left far past its own bound (1.90 s, 2.5x its bound, before brief lost
    # requests went first in the late turns; 0.97 s since)
    assert max(r.ttft for r in stream) <= 1.5 * (stream[0].ttft_target_s + stream[0].late_s)


def test_late_work_runs_in_turns_of_its_share() -> None:
    """While critical work waits beside on-time work, the scheduler wakes itself to give it its turn,
    and takes it back: no event is needed."""
    s, clock, _ = make_scheduler("flowprefill")
    s.late = type(s.late)(0.5)
    lost = req("lost", 16000, "interactive", 0.0)  # cannot make even its bound: lost at once
    s.on_arrival(lost)
    clock.t = 0.001
    fresh = req("fresh", 100, "batch", 0.001)
    s.on_arrival(fresh)
    assert s.chosen.requests == [fresh]  # on time first
    assert s.wake_at == pytest.approx(0.001 + s.late.quantum_s / 0.5)
    clock.t = s.wake_at
    s.on_timer()
    assert s.late.turn and s.chosen.requests == [lost]  # its turn: the on-time batch is preempted
    assert s.wake_at == pytest.approx(clock.t + s.late.quantum_s / 0.5)
    clock.t = s.wake_at
    s.on_timer()
    assert not s.late.turn and s.chosen.requests == [fresh]


def test_a_batch_is_as_urgent_as_its_most_savable_request() -> None:
    """An on-time request batched with a lost one keeps the batch on time, by its own deadline: judged
    by the lost one's, the batch (and the on-time request in it) would yield to any on-time arrival."""
    from engine.core.scheduler.slack import ON_TIME

    s, clock, _ = make_scheduler("flowprefill")
    clock.t = 10.0
    stale = req("stale", 200, "standard", 0.0)  # due at 0.5 s, bound 1.5 s: lost by now
    s.waiting.append(stale)
    fresh = req("fresh", 100, "interactive", 10.0)
    s.on_arrival(fresh)
    batch = s.chosen
    assert batch.requests == [fresh, stale]  # it fits the head's budget
    clock.t = 10.001
    s.on_arrival(req("later", 100, "relaxed", 10.001))
    assert s.judged(batch) == (ON_TIME, fresh.deadline)
    assert s.chosen is batch  # not preempted for a later deadline


def test_a_batch_is_judged_by_its_most_savable_request() -> None:
    """An on-time request keeps its batch on time, whether the others are late or lost."""
    from engine.core.scheduler.slack import ON_TIME, judge
    from engine.model.cost import SeqSpan

    s, clock, _ = make_scheduler("flowprefill")
    s.now = clock.t = 10.0
    fresh = req("fresh", 100, "interactive", 10.0)
    for other in (req("late", 100, "standard", 9.4), req("lost", 100, "standard", 0.0)):  # bound 10.9 s; 1.5 s
        batch = s._make_batch([other, fresh], [SeqSpan(0, 100), SeqSpan(0, 100)])
        assert judge(s, batch, 0.01) == (ON_TIME, fresh.deadline)


def test_brief_lost_work_is_at_most_two_quanta() -> None:
    """One turn's worth, capped: a share near 1 (turns that hardly end) does not make all lost work brief."""
    from engine.core.scheduler.slack import LateShare

    assert LateShare(0.5).brief_s == pytest.approx(0.1)
    assert LateShare(0.2).brief_s == pytest.approx(0.0625)
    assert LateShare(1.0).brief_s == pytest.approx(0.1)


def test_in_a_late_turn_brief_lost_work_goes_before_critical_work() -> None:
    """A lost request that fits in one late turn runs first in the turn; a long lost one does not."""
    from engine.core.scheduler.slack import BRIEF_LOST, CRITICAL, LOST

    s, clock, _ = make_scheduler("flowprefill")
    s.late = type(s.late)(0.5)
    clock.t = now = 100.0
    long = req("long", 6000, "batch", 0.0)
    p = s.predict_s(long)
    long.arrival_time = now + 1.5 * p - long.ttft_target_s - long.late_s  # its bound 1.5 p away: critical
    long.deadline = long.arrival_time + long.ttft_target_s
    brief = req("brief", 100, "interactive", now - 5)
    huge = req("huge", 8000, "interactive", now - 5)
    s.waiting += [long, brief, huge]
    s.late.credit = s.late.quantum_s  # the late tier's turn is due
    s.on_arrival(req("fresh", 100, "interactive", now))
    assert [s.standing(r) for r in (long, brief, huge)] == [CRITICAL, BRIEF_LOST, LOST]
    assert s.late.turn and s.chosen.requests[0] is brief
    assert s.predict_s(brief) <= s.late.brief_s < s.predict_s(huge)


def test_a_late_request_of_a_shed_class_leaves_the_queue() -> None:
    """`late = "shed"`: once it can no longer meet its deadline while still queued, it leaves (the
    engine ends it, the worker answers 429); one whose prefill began is kept."""
    from engine.protocol.slo import SLOClass

    bulk = SLOClass("bulk", ttft_ms=300, tbt_ms=100, priority=0, sheddable=True, late="shed")
    s, clock, _ = make_scheduler("flowprefill", max_batch_tokens=1)
    s.on_arrival(req("busy", 100, "interactive", 0.0))
    queued = Request.for_class(bulk, request_id="q", prompt_token_ids=[1] * 100,
                               sampling=SamplingParams(max_tokens=1), arrival_time=0.0)
    started = Request.for_class(bulk, request_id="s", prompt_token_ids=[1] * 100,
                                sampling=SamplingParams(max_tokens=1), arrival_time=0.0)
    s.on_arrival(queued)
    started.times.prefill_start = 0.0  # a chunked prompt between its chunks
    s.on_arrival(started)
    assert not s.shed and queued in s.waiting
    clock.t = 1.0
    s.on_completion(s.chosen)
    assert s.shed == [queued] and queued not in s.waiting
    assert started in s.waiting or any(started in b.requests for b in s.pool)


def test_a_shed_class_needs_to_be_sheddable() -> None:
    from engine.protocol.slo import SLOClass

    with pytest.raises(ValueError, match="sheddable"):
        SLOClass("x", ttft_ms=100, tbt_ms=100, priority=0, late="shed")
    assert SLOClass("x", ttft_ms=100, tbt_ms=100, priority=0).late_bound_ms == 200
    assert SLOClass("x", ttft_ms=100, tbt_ms=100, priority=0, late_ms=50).late_bound_ms == 50


def test_a_waiting_request_s_prediction_is_remembered_until_its_prompt_or_the_correction_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decision judges every waiting request: `predict_s` computes each once, and again when the
    cost model's correction or host time, its step budget or the request's prompt left changes (or the
    model itself); its calibrated terms only when the prompt left or the calibration does."""
    s, _, _ = make_scheduler("flowprefill")
    s.cost = copy.deepcopy(COST)
    r = req("doc", 4000, "relaxed", 0.0)
    computed: list[float] = []
    real = s.predict_batch_s
    monkeypatch.setattr(s, "predict_batch_s",
                        lambda reqs, terms=None: computed.append(real(reqs, terms)) or computed[-1])
    made: list[list[SeqSpan]] = []
    real_terms = OpCost.prefill_terms
    monkeypatch.setattr(OpCost, "prefill_terms", lambda cost, spans: made.append(spans) or real_terms(cost, spans))
    first = s.predict_s(r)
    assert s.predict_s(r) == first and len(computed) == 1 and len(made) == 1
    s.cost.machine = 2.0  # the correction learned a 2x slowdown
    slower = s.predict_s(r)
    assert slower == pytest.approx(2 * first, rel=0.02) and len(computed) == 2 and len(made) == 1
    s.cost.batch_host_s = 0.001  # and a host time per batch
    assert s.predict_s(r) == pytest.approx(slower + 0.001) and len(computed) == 3 and len(made) == 1
    r.num_computed_tokens = 2048  # a chunk ran
    assert s.predict_s(r) < slower and len(computed) == 4 and len(made) == 2
    s.cost.budget_s = (s.cost.budget_s or 0.002) * 2
    s.predict_s(r)
    assert len(made) == 3
    s.cost = copy.deepcopy(s.cost)  # another model, the same numbers: asked anew
    s.predict_s(r)
    assert len(computed) == 6 and len(made) == 4 and s.predict_s(r) == computed[-1] and len(computed) == 6


def test_the_backlog_is_predicted_with_the_correction_as_it_is_now() -> None:
    """GET /load's backlog, which the gateway routes on: a formed batch's remaining work on the scale
    of the waiting requests' predictions, the correction now, not as it was when the batch was planned."""
    s, _, _ = make_scheduler("flowprefill")
    s.cost = copy.deepcopy(COST)  # it learns below; the module's is every test's
    s.on_arrival(req("long", 8000, "batch", 0.0))
    batch = s.chosen
    assert batch is not None
    batch.advance()
    s.on_arrival(req("next", 8000, "batch", 0.0))  # queued behind it: its deadline is no earlier
    formed, waiting = s.backlog()
    assert formed == pytest.approx(batch.remaining_s) and waiting["batch"] == pytest.approx(s.predict_s(s.waiting[0]))
    s.cost.machine = 3.0  # the correction learned a 3x slowdown
    formed_now, waiting_now = s.backlog()
    assert formed_now == pytest.approx(3 * formed) and waiting_now["batch"] == pytest.approx(3 * waiting["batch"])


def _late_pair(host_s: float) -> list[list[str]]:
    """A late 1,000-token head and a 16-token request queued behind it: the batch FlowPrefill forms."""
    s, clock, _ = make_scheduler("flowprefill")
    s.cost = copy.copy(COST)
    s.cost.batch_host_s = host_s
    clock.t = 100.0  # both long past their bounds: the head misses whatever runs with it
    s.waiting += [req("head", 1000, "interactive", 0.0), req("small", 16, "interactive", 0.01)]
    s.on_timer()
    return [[r.request_id for r in b.requests] for b in s.pool]


def test_a_late_head_takes_a_request_whose_own_batch_would_cost_more_host_time_than_it_adds() -> None:
    small_alone = COST.prefill_s([SeqSpan(0, 16)])
    assert _late_pair(host_s=0.0) == [["head"]]  # no host time: joining only delays the head
    assert _late_pair(host_s=4 * small_alone) == [["head", "small"]]


def test_predictions_count_the_host_time_once_per_batch() -> None:
    s, _, _ = make_scheduler("fcfs")
    s.cost = copy.copy(COST)
    s.cost.batch_host_s = 0.01
    a, b = req("a", 300, "standard", 0.0), req("b", 500, "standard", 0.0)
    assert s.predict_batch_s([a, b]) == pytest.approx(COST.prefill_s([SeqSpan(0, 300), SeqSpan(0, 500)]) + 0.01)
    assert s.predict_s(a) == pytest.approx(COST.prefill_s([SeqSpan(0, 300)]) + 0.01)
