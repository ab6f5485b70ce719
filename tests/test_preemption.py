"""Operator-level preemption and the sub-operator split, checked numerically.

A prefill batch is a generator of operator steps. Stopping it at any boundary, running other
batches on the same model and KV pool, and resuming it must give exactly the logits (and KV) of an
uninterrupted run; splitting operators into blocks/tiles must agree with the unsplit forward to
fp32 rounding; chunked spans and ragged batches must agree with whole prompts run alone.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import replace
from itertools import pairwise
from typing import ClassVar

import pytest
import torch
from helpers import drain

from engine.attention import MergedTiles
from engine.attention.sdpa import SDPABackend
from engine.core.config import ModelConfig
from engine.core.kv_cache import KVCache
from engine.core.prefill import PrefillBatch
from engine.core.request import Request
from engine.model.cost import ATTENTION, ATTN_IN, FFN, HEAD, OpCost, SeqSpan, Step
from engine.model.llama import LlamaModel
from engine.model.loader import expected_shapes
from engine.model.plan import plan_prefill

# A small Qwen2-shaped model (GQA group 2, q/k/v bias): fast, and the same code paths as the default.
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                  eos_token_id=[0], name="tiny-preempt")
# Fixed predicted costs make the plans (and so the tested boundaries) deterministic.
COST = OpCost(CFG, attn_in_s_per_row=1e-6, ffn_s_per_row=1e-6, attn_s_per_pair=1e-8, step_overhead_s=0.0)
BUDGET = 5e-5  # -> 32-row blocks, 64-query blocks, 128-key tiles with COST
BLOCK = 16
EXACT = {"rtol": 0.0, "atol": 1e-6}  # preempt/resume: the same ops on the same data
FP32 = {"rtol": 1e-5, "atol": 1e-5}  # split vs unsplit: different reduction orders


def make_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (1.0 + 0.1 * torch.randn(shape, generator=gen)) if name.endswith("norm.weight")
        else torch.randn(shape, generator=gen) * scale
        for name, shape in expected_shapes(cfg).items()
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Generator[None, None, None]:
    """Tiny ops on shared cores: one intra-op thread is many times faster (and restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(CFG, make_weights(CFG), SDPABackend())


def fresh_kv(capacity: int = 8192) -> KVCache:
    """A pool whose unwritten slots are NaN: reading KV that was never written poisons the logits."""
    kv = KVCache(CFG, BLOCK, capacity, torch.float32, "cpu")
    for t in (*kv.k, *kv.v):
        t.fill_(float("nan"))
    return kv


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


def new_batch(reqs: list[Request], spans: list[SeqSpan], model: LlamaModel, kv: KVCache,
              budget: float | None, cost: OpCost = COST) -> PrefillBatch:
    return PrefillBatch.on_model(reqs, spans, model, kv, cost, budget)


def run(batch: PrefillBatch, max_steps: int | None = None) -> bool:
    """Advance up to max_steps steps (None: to completion). True when finished."""
    n = 0
    while max_steps is None or n < max_steps:
        if batch.advance():
            return True
        n += 1
    return False


class Case:
    """Requests of several batches, their spans, and the allocation order of their KV blocks.

    `setup(kv)` allocates blocks (interleaved between batches, so batches sit on neighbouring blocks),
    writes the cached prefixes of chunked spans, and returns fresh (not yet started) PrefillBatches."""

    def __init__(self, batches: list[list[tuple[int, int, int]]], budget: float | None = BUDGET,
                 cost: OpCost = COST) -> None:
        # each batch: [(prompt_len, span_start, span_len)]
        self.spec = batches
        self.budget, self.cost = budget, cost

    def setup(self, model: LlamaModel, kv: KVCache) -> list[PrefillBatch]:
        reqs: list[list[Request]] = []
        for b, batch in enumerate(self.spec):
            reqs.append([Request(request_id=f"b{b}r{i}", prompt_token_ids=prompt(n, 10 * b + i))
                         for i, (n, _, _) in enumerate(batch)])
        # interleave allocations: b0r0, b1r0, b2r0, ..., b0r1, b1r1, ...
        for i in range(max(len(b) for b in self.spec)):
            for b, batch in enumerate(self.spec):
                if i < len(batch):
                    reqs[b][i].block_table = kv.allocate(batch[i][0])
        for b, batch in enumerate(self.spec):
            for r, (_, start, _) in zip(reqs[b], batch, strict=True):
                if start:  # the cached prefix a chunked span continues from
                    assert run(new_batch([r], [SeqSpan(0, start)], model, kv, None))
        return [new_batch(reqs[b], [SeqSpan(s, n) for _, s, n in batch], model, kv, self.budget, self.cost)
                for b, batch in enumerate(self.spec)]

    def reference(self, model: LlamaModel) -> list[tuple[torch.Tensor, list]]:
        """Each batch run alone and uninterrupted: its logits and the KV it owns."""
        out = []
        for b in range(len(self.spec)):
            kv = fresh_kv()
            batches = self.setup(model, kv)
            assert run(batches[b])
            out.append((batches[b].logits, kv_of(kv, batches[b])))
        return out


def kv_of(kv: KVCache, batch: PrefillBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [kv.gather(layer, r.block_table, s.start + s.length)
            for r, s in zip(batch.requests, batch.spans, strict=True) for layer in range(CFG.num_hidden_layers)]


def assert_kv_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        torch.testing.assert_close(gk, wk, **EXACT)
        torch.testing.assert_close(gv, wv, **EXACT)


# -- attention tiles -----------------------------------------------------------------------------

@pytest.mark.parametrize(("n_q", "n_k", "kv_heads"), [(37, 37, 2), (37, 200, 2), (64, 300, 8), (1, 90, 1)])
def test_causal_tile_is_bottom_right_aligned(n_q: int, n_k: int, kv_heads: int) -> None:
    """A causal tile's queries are the last n_q positions of its keys: query j sees keys up to
    n_k - n_q + j (what FlashInfer's causal kernels do). Against an explicit masked softmax."""
    gen = torch.Generator().manual_seed(n_q + n_k)
    q = torch.randn(n_q, 8, 16, generator=gen)
    k, v = torch.randn(n_k, kv_heads, 16, generator=gen), torch.randn(n_k, kv_heads, 16, generator=gen)
    out, lse = SDPABackend().tile(q, k, v, True)
    kk, vv = k.repeat_interleave(8 // kv_heads, 1), v.repeat_interleave(8 // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 16**-0.5
    visible = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, scores.logsumexp(-1).T, atol=1e-5, rtol=1e-5)


def test_merged_tiles_give_the_whole() -> None:
    """Any backend's tiles of a query block (`MergedTiles`: each tile's LSE kept, merged at the last)
    equal one causal tile over every key."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(40, 8, 16, generator=gen)
    k, v = torch.randn(300, 2, 16, generator=gen), torch.randn(300, 2, 16, generator=gen)
    tiles = MergedTiles(SDPABackend(), q)
    assert tiles.add(k[:100], v[:100], causal=False, last=False) is None
    assert tiles.add(k[100:260], v[100:260], causal=False, last=False) is None
    got = tiles.add(k[260:], v[260:], causal=True, last=True)
    torch.testing.assert_close(got, SDPABackend().tile(q, k, v, True)[0], atol=1e-5, rtol=1e-5)


# -- the plan ------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [None, BUDGET, 2e-5, 1e-9])
def test_plan_partitions_every_operator(budget: float | None) -> None:
    spans = [SeqSpan(0, 150), SeqSpan(40, 90), SeqSpan(0, 1), SeqSpan(100, 3)]
    steps = plan_prefill(COST, spans, budget)
    rows = sum(s.length for s in spans)
    starts = [0]
    for s in spans:
        starts.append(starts[-1] + s.length)
    assert [s.layer for s in steps] == sorted(s.layer for s in steps)
    for layer in range(CFG.num_hidden_layers):
        mine = [s for s in steps if s.layer == layer]
        kinds = [s.op for s in mine]
        # all q/k/v projections, then all attention tiles, then all FFN blocks (the last layer: the head)
        assert kinds == sorted(kinds, key=[ATTN_IN, ATTENTION, FFN, HEAD].index)
        heads = [s for s in mine if s.op == HEAD]
        if layer < CFG.num_hidden_layers - 1:
            assert heads == []
        else:  # every sequence's logits over the whole vocabulary, each column once
            assert heads[0].cols[0] == 0 and heads[-1].cols[1] == CFG.vocab_size
            assert all(a.cols[1] == b.cols[0] for a, b in pairwise(heads))
            assert all(h.rows == (0, len(spans)) for h in heads)
        for op in (ATTN_IN, FFN):
            blocks = [s.rows for s in mine if s.op == op]
            assert blocks[0][0] == 0 and blocks[-1][1] == rows
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in pairwise(blocks))
        for i, span in enumerate(spans):
            tiles = [s for s in mine if s.op == ATTENTION and s.seq == i]
            qblocks: list[list[Step]] = []
            for t in tiles:
                if not qblocks or qblocks[-1][-1].causal:
                    qblocks.append([])
                qblocks[-1].append(t)
            covered = starts[i]
            for qb in qblocks:
                a, b = qb[0].rows
                assert a == covered and b > a and all(t.rows == (a, b) for t in qb)
                covered = b
                qs, qe = a - starts[i] + span.start, b - starts[i] + span.start  # absolute positions
                # the last tile is causal and ends at the queries' own positions; it starts at the
                # block's first query (the diagonal square) or, all keys fitting one step, at 0
                assert qb[-1].causal and qb[-1].keys[1] == qe and qb[-1].keys[0] in (qs, 0)
                assert not any(t.causal for t in qb[:-1])
                keys = [t.keys for t in qb[:-1]]
                if qb[-1].keys[0] == 0:
                    assert keys == []
                else:  # the off-diagonal tiles cover keys [0, qs) exactly once, in order
                    assert keys[0][0] == 0 and keys[-1][1] == qs
                    assert all(x[1] == y[0] and x[0] < x[1] for x, y in pairwise(keys))
            assert covered == starts[i + 1]
    if budget is None:
        # one step per operator: 1 projection, one attention step per sequence, 1 FFN
        per_layer = 2 + len(spans)
        assert len(steps) == per_layer * CFG.num_hidden_layers + 1  # and the head
    elif budget >= BUDGET / 2:
        assert all(s.cost <= budget * (1 + 1e-9) for s in steps), "a step is predicted to outlast the budget"


# -- preempt at every boundary -------------------------------------------------------------------

def test_preempt_at_every_boundary(model: LlamaModel) -> None:
    # Batch A: a whole prompt and a chunk over a cached prefix (ragged). Batch B runs in between.
    case = Case([[(120, 0, 120), (134, 64, 70)], [(90, 0, 90), (60, 20, 40)]])
    (ref_a, ref_a_kv), (ref_b, ref_b_kv) = case.reference(model)
    n_steps = len(case.setup(model, fresh_kv())[0].steps)
    assert 20 <= n_steps <= 200, n_steps  # tens of boundaries, each tried
    for k in range(n_steps + 1):
        kv = fresh_kv()
        a, b = case.setup(model, kv)
        assert not run(a, k)
        assert a.next_step == k and a.started == (k > 0)
        assert run(b), "the other batch must run to completion in between"
        torch.testing.assert_close(b.logits, ref_b, **EXACT)
        assert run(a)
        assert a.finished and a.remaining_s == pytest.approx(0.0, abs=1e-12)
        torch.testing.assert_close(a.logits, ref_a, **EXACT, msg=lambda m, k=k: f"preempted after step {k}: {m}")
        assert_kv_equal(kv_of(kv, a), ref_a_kv)
        assert_kv_equal(kv_of(kv, b), ref_b_kv)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleaving_of_several_batches(model: LlamaModel, seed: int) -> None:
    case = Case([
        [(100, 0, 100)],
        [(80, 0, 80), (108, 48, 60)],
        [(200, 0, 200)],
        [(1, 0, 1), (33, 0, 33)],
        [(75, 70, 5)],
    ])
    refs = case.reference(model)
    rng = random.Random(seed)
    kv = fresh_kv()
    batches = case.setup(model, kv)
    live = list(range(len(batches)))
    switches = 0
    last = None
    while live:
        i = rng.choice(live)
        switches += i != last
        last = i
        if run(batches[i], rng.randint(1, 4)):
            live.remove(i)
    assert switches > 10
    for batch, (ref, ref_kv) in zip(batches, refs, strict=True):
        torch.testing.assert_close(batch.logits, ref, **EXACT)
        assert_kv_equal(kv_of(kv, batch), ref_kv)


def test_closing_a_suspended_batch_does_not_disturb_others(model: LlamaModel) -> None:
    case = Case([[(100, 0, 100)], [(70, 0, 70)]])
    (_, _), (ref_b, _) = case.reference(model)
    kv = fresh_kv()
    a, b = case.setup(model, kv)
    assert not run(a, 7)
    a.close()
    with pytest.raises(StopIteration):  # a closed generator is finished for good
        next(a._run)
    assert run(b)
    torch.testing.assert_close(b.logits, ref_b, **EXACT)


# -- the sub-operator split ------------------------------------------------------------------------

def logits_of(model: LlamaModel, spec: list[tuple[int, int, int]], budget: float | None, cost: OpCost = COST
              ) -> torch.Tensor:
    kv = fresh_kv()
    batch = Case([spec], budget, cost).setup(model, kv)[0]
    assert run(batch)
    assert torch.isfinite(batch.logits).all()
    return batch.logits


@pytest.mark.parametrize("budget", [BUDGET, 2e-5, 1e-9])
def test_split_equals_unsplit(model: LlamaModel, budget: float) -> None:
    spec = [(300, 0, 300), (47, 0, 47), (250, 130, 120), (1, 0, 1)]
    whole = logits_of(model, spec, None)
    split = logits_of(model, spec, budget)
    spans = [SeqSpan(s, n) for _, s, n in spec]
    assert len(plan_prefill(COST, spans, budget)) > 5 * len(plan_prefill(COST, spans, None))
    torch.testing.assert_close(split, whole, **FP32)


def test_the_head_is_cut_by_vocabulary_columns_within_the_budget(model: LlamaModel) -> None:
    # A head longer than the budget (a real model's lm_head on a CPU: 11 ms in fp32 for SmolLM2-135M); this
    # vocabulary of 128 is two blocks of 64 columns.
    cost = OpCost(CFG, attn_in_s_per_row=1e-6, ffn_s_per_row=1e-6, attn_s_per_pair=1e-8, step_overhead_s=0.0,
                  head_s=1.5 * BUDGET, head_s_per_row=BUDGET / 8)
    spec = [(40, 0, 40), (7, 0, 7)]
    spans = [SeqSpan(s, n) for _, s, n in spec]
    heads = [s for s in plan_prefill(cost, spans, BUDGET) if s.op == HEAD]
    assert [h.cols for h in heads] == [(0, 64), (64, 128)] and all(h.cost <= BUDGET for h in heads)
    assert sum(h.cost for h in heads) == pytest.approx(cost.head_op_s(2, CFG.vocab_size))
    assert [h.cols for h in plan_prefill(cost, spans, None) if h.op == HEAD] == [(0, CFG.vocab_size)]
    # The plan's total is what the cost model predicts for the batch: the head included.
    plan = plan_prefill(cost, spans, BUDGET, last_token_only=True)
    assert plan.total_cost == pytest.approx(replace(cost, budget_s=BUDGET).prefill_s(spans), rel=0.02)
    torch.testing.assert_close(logits_of(model, spec, BUDGET, cost), logits_of(model, spec, None, cost), **EXACT)


def test_split_equals_unsplit_long_prompt(model: LlamaModel) -> None:
    # Cheaper attention per pair -> 256-query blocks with 384-key tiles: up to 8 key tiles per block,
    # tile edges that do not line up with query blocks.
    cost = OpCost(CFG, attn_in_s_per_row=1e-6, ffn_s_per_row=1e-6, attn_s_per_pair=1e-9, step_overhead_s=0.0)
    budget = 1e-4
    n = 3000
    steps = plan_prefill(cost, [SeqSpan(0, n)], budget)
    per_block: dict[tuple[int, int], int] = {}
    for s in steps:
        if s.op == ATTENTION and not s.causal and s.layer == 0:
            per_block[s.rows] = per_block.get(s.rows, 0) + 1
    assert max(per_block.values()) >= 3, "the long prompt must have several key tiles per query block"
    whole = logits_of(model, [(n, 0, n)], None, cost)
    split = logits_of(model, [(n, 0, n)], budget, cost)
    torch.testing.assert_close(split, whole, **FP32)


@pytest.mark.parametrize("budget", [None, BUDGET])
def test_chunked_spans_equal_whole_prompt(model: LlamaModel, budget: float | None) -> None:
    n = 300
    ids = prompt(n, 77)
    plan = [(0, 100), (100, 150), (250, 49), (299, 1)]  # chunk edges off the 16-token KV blocks
    kv = fresh_kv()
    req = Request(request_id="whole", prompt_token_ids=ids)
    req.block_table = kv.allocate(n)
    steps = plan_prefill(COST, [SeqSpan(0, n)], budget)
    whole_all = drain(model.prefill([ids], [SeqSpan(0, n)], [req.block_table], kv, steps, all_logits=True))
    whole_kv = [kv.gather(layer, req.block_table, n) for layer in range(CFG.num_hidden_layers)]

    kv2 = fresh_kv()
    chunked = Request(request_id="chunked", prompt_token_ids=ids)
    chunked.block_table = kv2.allocate(n)
    rows = []
    for start, length in plan:
        span = [SeqSpan(start, length)]
        steps = plan_prefill(COST, span, budget)
        rows.append(drain(model.prefill([ids[start : start + length]], span, [chunked.block_table], kv2, steps,
                                        all_logits=True)))
    torch.testing.assert_close(torch.cat(rows), whole_all, **FP32)
    for layer in range(CFG.num_hidden_layers):
        for got, want in zip(kv2.gather(layer, chunked.block_table, n), whole_kv[layer], strict=True):
            torch.testing.assert_close(got, want, **FP32)

    # Through PrefillBatch: the last chunk's logits are the whole prompt's last-token logits.
    kv3 = fresh_kv()
    r = Request(request_id="pb", prompt_token_ids=ids)
    r.block_table = kv3.allocate(n)
    for start, length in plan:
        batch = new_batch([r], [SeqSpan(start, length)], model, kv3, budget)
        assert run(batch)
    torch.testing.assert_close(batch.logits[0], whole_all[-1], **FP32)


@pytest.mark.parametrize("budget", [None, BUDGET])
def test_ragged_batch_equals_each_request_alone(model: LlamaModel, budget: float | None) -> None:
    spec = [(1, 0, 1), (17, 0, 17), (64, 0, 64), (130, 0, 130), (90, 40, 50)]
    together = logits_of(model, spec, budget)
    assert together.shape == (len(spec), CFG.vocab_size)
    for i, item in enumerate(spec):
        kv = fresh_kv()
        # the same prompt (same seed) as in the batch: Case seeds prompts by position
        reqs = Case([spec], budget).setup(model, kv)[0].requests
        alone = new_batch([reqs[i]], [SeqSpan(item[1], item[2])], model, kv, budget)
        assert run(alone)
        torch.testing.assert_close(together[i], alone.logits[0], **FP32)


# -- the last layer computes what is read --------------------------------------------------------

@pytest.mark.parametrize("budget", [None, BUDGET])
def test_last_token_only_plan_gives_same_logits_and_kv(model: LlamaModel, budget: float | None) -> None:
    """The serving plan skips last-layer attention/MLP rows whose outputs are never read; the
    last-token logits and every layer's KV stay those of the full forward."""
    from engine.model.plan import plan_prefill

    spans = [SeqSpan(0, 37), SeqSpan(0, 300), SeqSpan(0, 1)]
    ids = [prompt(s.length, i) for i, s in enumerate(spans)]
    results = []
    for last_only in (False, True):
        kv = fresh_kv()
        tables = [kv.allocate(s.length) for s in spans]
        plan = plan_prefill(COST, spans, budget, last_token_only=last_only)
        logits = drain(model.prefill(ids, spans, tables, kv, plan))
        kvs = [kv.gather(layer, t, s.length) for t, s in zip(tables, spans, strict=True)
               for layer in range(CFG.num_hidden_layers)]
        results.append((plan, logits, kvs))
    (full, full_logits, full_kv), (trim, trim_logits, trim_kv) = results
    torch.testing.assert_close(trim_logits, full_logits, rtol=1e-5, atol=1e-6)
    assert_kv_equal(trim_kv, full_kv)
    assert trim.total_cost < full.total_cost
    # The scheduler's closed-form prediction is within rounding of tiles of what the plan costs.
    assert trim.total_cost == pytest.approx(COST.prefill_s(spans), rel=0.25)
    steps = list(trim)
    assert [trim[i] for i in range(len(trim))] == steps
    assert all(trim.cost_before(i + 1) - trim.cost_before(i) == pytest.approx(steps[i].cost) for i in range(len(trim)))


class _FakeEvent:
    """Stands in for torch.cuda.Event: records what the run-ahead waited for."""

    log: ClassVar[list[int]] = []
    count = 0

    def __init__(self) -> None:
        _FakeEvent.count += 1
        self.n = _FakeEvent.count

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        _FakeEvent.log.append(self.n)


def test_run_ahead_keeps_the_device_fed_and_the_queue_short() -> None:
    """On an asynchronous device the host may queue about `limit_s` of predicted work, and always
    the step it has just queued (the device runs it while the host prepares the next, so a stop waits
    for two steps at most); it waits for the oldest steps first."""
    from engine.core.prefill import RunAhead

    _FakeEvent.log, _FakeEvent.count = [], 0
    ahead = RunAhead(torch.device("cpu"), limit_s=0.002, new_event=_FakeEvent)
    for _ in range(10):  # short steps: up to 2 ms of them stay queued
        ahead.step_queued(0.0005)
        assert 2 <= ahead.queued <= 4 or _FakeEvent.count < 2
    assert _FakeEvent.log == [1, 2, 3, 4, 5, 6]  # oldest first, never more than needed
    for _ in range(3):  # long steps: the one just queued, which the device runs meanwhile
        ahead.step_queued(0.010)
        assert ahead.queued == 1
    ahead.step_queued(0.0005)  # a short step behind a long one: the long one is waited for
    assert ahead.queued == 1 and _FakeEvent.log[-1] == _FakeEvent.count - 1
    ahead.drain()
    assert ahead.queued == 0 and _FakeEvent.log[-1] == _FakeEvent.count
    assert RunAhead(torch.device("cpu")).queued == 0  # on the CPU: nothing to track


def test_a_suspension_records_the_queued_work_its_stop_waited_for(model: LlamaModel) -> None:
    """On an asynchronous device a stop waits for the steps already queued: the suspension says how
    many and their predicted time (how a slow stop is told from a mispredicted step)."""
    from engine.core.prefill import RunAhead

    kv = fresh_kv()
    req = Request(request_id="r", prompt_token_ids=prompt(300, 1))
    req.block_table = kv.allocate(300)
    batch = new_batch([req], [SeqSpan(0, 300)], model, kv, BUDGET)
    batch._device = RunAhead(torch.device("cpu"), limit_s=1.0, new_event=_FakeEvent)  # as on CUDA
    assert not run(batch, 4)
    queued = batch.wait_device()
    assert queued == (4, pytest.approx(sum(batch.steps.cost(i) for i in range(4))))
    batch.suspend(1.0, 0.99, None, queued)
    s = req.times.suspensions[-1]
    assert (s.queued_steps, s.queued_predicted_s) == queued and s.stop_latency_s == pytest.approx(0.01)
    assert batch.wait_device() == (0, 0.0)  # drained
    batch.close()
    kv.free(req.block_table)
