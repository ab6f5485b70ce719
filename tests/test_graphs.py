"""Piecewise CUDA graphs (engine/model/graphs.py), their buffer plumbing checked on the CPU.

A CUDA graph replays, on the same buffers, the kernels its capture recorded. On the CPU the stand-in
below replays by calling the captured function again, which does the same work on the same buffers:
what these tests check is everything around the graphs (padding to a bucket, views of the bucket's
buffers, steps that cover part of the rows, leases held across suspensions). tests/test_flashinfer.py
checks real CUDA graphs against the eager forward on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RerunCapture
from test_preemption import BUDGET, CFG, COST, FP32, fresh_kv, kv_of, make_weights, prompt, run

from engine.attention.sdpa import SDPABackend
from engine.core.prefill import PrefillBatch
from engine.core.request import Request
from engine.model.cost import SeqSpan
from engine.model.graphs import StepGraphs
from engine.model.llama import LlamaModel


def graph_model(max_tokens: int = 256) -> tuple[LlamaModel, RerunCapture]:
    model = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    capture = RerunCapture()
    model.graphs = StepGraphs(model, max_tokens, capture)
    return model, capture


@pytest.fixture(scope="module")
def eager() -> LlamaModel:
    return LlamaModel(CFG, make_weights(CFG), SDPABackend())


def batch(model: LlamaModel, kv, lengths: list[int], budget: float | None, seed: int = 0,
          start: int = 0) -> PrefillBatch:
    reqs = []
    for i, n in enumerate(lengths):
        r = Request(request_id=f"r{seed}-{i}", prompt_token_ids=prompt(start + n, seed + i))
        r.block_table = kv.allocate(start + n)
        if start:  # a cached prefix: this batch is a later chunk of the prompt
            assert run(PrefillBatch.on_model([r], [SeqSpan(0, start)], model, kv, COST, None))
        reqs.append(r)
    return PrefillBatch.on_model(reqs, [SeqSpan(start, n) for n in lengths], model, kv, COST, budget)


def finished(b: PrefillBatch) -> torch.Tensor:
    assert run(b)
    assert b.logits is not None
    return b.logits


@pytest.mark.parametrize(("lengths", "start"), [([100], 0), ([37, 50], 0), ([20, 1, 90], 0), ([60], 40)],
                         ids=["one", "ragged", "ragged-3", "chunk"])
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["unsplit", "split"])
def test_graphs_give_the_eager_logits_and_kv(eager: LlamaModel, lengths: list[int], start: int,
                                             budget: float | None) -> None:
    """Padded to a bucket, whole steps replayed and partial ones run on the bucket's views."""
    model, capture = graph_model()
    kv_e, kv_g = fresh_kv(), fresh_kv()
    b_e, b_g = batch(eager, kv_e, lengths, budget, start=start), batch(model, kv_g, lengths, budget, start=start)
    capture.replays = 0  # count this batch's (a chunk's prefix ran through graphs too)
    torch.testing.assert_close(finished(b_g), finished(b_e), **FP32)
    for (gk, gv), (ek, ev) in zip(kv_of(kv_g, b_g), kv_of(kv_e, b_e), strict=True):
        torch.testing.assert_close(gk, ek, **FP32)
        torch.testing.assert_close(gv, ev, **FP32)
    whole_steps = sum(s.op != "attention" and s.rows == (0, sum(lengths)) for s in b_g.steps)
    assert capture.replays == whole_steps
    if budget is None:  # all but the last layer's MLP, which only runs the last tokens' rows
        assert capture.replays == 2 * CFG.num_hidden_layers - 1
    assert not any(buf.leased for buf in model.graphs._buckets.values())


def test_a_suspended_batch_keeps_its_bucket(eager: LlamaModel) -> None:
    """A batch holds its bucket's buffers while suspended: a batch of the same bucket runs eagerly
    meanwhile, one of another bucket replays its own graphs, and the first resumes unharmed."""
    model, capture = graph_model()
    kv = fresh_kv()
    want = {n: finished(batch(eager, fresh_kv(), [n], None, seed=n)) for n in (100, 110, 20)}
    long = batch(model, kv, [100], None, seed=100)
    assert not run(long, 5)
    held = model.graphs._buckets[128]
    assert held.leased
    before = capture.replays
    torch.testing.assert_close(finished(batch(model, kv, [110], None, seed=110)), want[110], **FP32)
    assert capture.replays == before  # same bucket: eager
    torch.testing.assert_close(finished(batch(model, kv, [20], None, seed=20)), want[20], **FP32)
    assert capture.replays == before + 2 * CFG.num_hidden_layers - 1  # bucket 32: its own graphs
    assert held.leased
    torch.testing.assert_close(finished(long), want[100], **FP32)
    assert not any(buf.leased for buf in model.graphs._buckets.values())


def test_closing_a_suspended_batch_releases_its_bucket() -> None:
    model, _ = graph_model()
    kv = fresh_kv()
    b = batch(model, kv, [100], None)
    assert not run(b, 3)
    assert model.graphs._buckets[128].leased
    b.close()  # a cancelled request's batch
    assert not model.graphs._buckets[128].leased
    assert model.graphs.lease(128) is model.graphs._buckets[128]


def test_buckets() -> None:
    model, _ = graph_model(max_tokens=300)
    graphs = model.graphs
    assert graphs.sizes == [16, 32, 64, 128, 256] and graphs.max_tokens == 256
    got = graphs.lease(17)
    assert got is not None and got.size == 32 and got.leased
    assert graphs.lease(20) is None  # bucket 32 is leased
    assert graphs.lease(257) is None  # past the largest bucket: eager
    StepGraphs.release(got)
    assert graphs.lease(32) is got
    with pytest.raises(ValueError, match="cuda_graph_tokens"):
        StepGraphs(model, 8)
