"""A CPU prefill's activation buffers, kept between prefills (engine/model/activations.py): leased, so
a suspended prefill keeps its own while another runs, and returned however a prefill ends."""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch
from helpers import drain
from test_preemption import BUDGET, CFG, COST, EXACT, fresh_kv, make_weights, prompt

from engine.attention.sdpa import SDPABackend
from engine.model.activations import MAX_KEPT_ROWS, MIN_ROWS, ActivationPool
from engine.model.cost import SeqSpan
from engine.model.llama import LlamaModel
from engine.model.plan import plan_prefill


@pytest.fixture(autouse=True)
def one_thread() -> Generator[None, None, None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(model: LlamaModel, n: int, seed: int) -> Generator[int, None, torch.Tensor]:
    kv = fresh_kv()
    spans = [SeqSpan(0, n)]
    return model.prefill([prompt(n, seed)], spans, [kv.allocate(n)], kv, plan_prefill(COST, spans, BUDGET))


def test_interleaved_prefills_keep_their_own_buffers_and_give_each_ones_logits() -> None:
    model = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    alone = {n: drain(_run(model, n, seed=n)) for n in (300, 200)}
    assert model.activations.free_rows == [MIN_ROWS], "the finished prefills' lease is kept"
    long, short = _run(model, 300, seed=300), _run(model, 200, seed=200)
    for _ in range(7):  # the long one is suspended mid-way, the short one runs whole, then the long one resumes
        next(long)
    torch.testing.assert_close(drain(short), alone[200], **EXACT)
    torch.testing.assert_close(drain(long), alone[300], **EXACT)
    assert model.activations.free_rows == [MIN_ROWS, MIN_ROWS]


def test_a_closed_prefill_returns_its_lease_and_the_next_one_writes_into_it() -> None:
    model = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    run = _run(model, 1000, seed=1)
    next(run)
    assert model.activations.free_rows == []
    run.close()  # a cancelled batch, suspended
    assert model.activations.free_rows == [1024]
    (kept,) = model.activations._free
    again = _run(model, 700, seed=2)
    next(again)
    assert model.activations.free_rows == [], "a 700-token prefill fits the 1,024-row lease"
    again.close()
    assert model.activations._free == [kept]


def test_the_pool_keeps_the_largest_few_leases_and_none_past_its_bound() -> None:
    pool = ActivationPool(CFG, torch.float32, torch.device("cpu"), keep=2)
    leases = [pool.lease(n) for n in (10, 600, 3000)]
    assert [a.rows for a in leases] == [MIN_ROWS, 1024, 4096]
    for a in leases:
        pool.release(a)
    assert pool.free_rows == [1024, 4096]
    assert pool.lease(900) is leases[1] and pool.lease(900).rows == 4096 and pool.free_rows == []
    pool.release(pool.lease(MAX_KEPT_ROWS + 1))
    assert pool.free_rows == []


_FAULTS = """
import resource, sys
from dataclasses import replace
import torch
sys.path.insert(0, sys.argv[1])
from test_preemption import CFG
from engine.model.activations import MAX_KEPT_ROWS, ActivationPool

def faults_writing(pool, n):  # minor page faults this thread takes writing a lease's hidden states
    a = pool.lease(n)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    a.x.fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    pool.release(a)
    return faults

wide = replace(CFG, hidden_size=1024)  # 8K rows: 32 MB of hidden states
warm = ActivationPool(wide, torch.float32, torch.device("cpu"))
warm.warm(MAX_KEPT_ROWS * 4)  # bounded: what the pool would keep
assert warm.free_rows == [MAX_KEPT_ROWS], warm.free_rows
warm_faults = faults_writing(warm, 8192)
cold_faults = faults_writing(ActivationPool(wide, torch.float32, torch.device("cpu")), 8192)
print(cold_faults, warm_faults)
"""


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="Linux's per-thread page faults")
def test_a_warmed_pool_serves_the_first_long_prefill_from_pages_already_mapped() -> None:
    """The engine warms its pool at start-up for its longest prompt: the first long prefill's first
    steps wrote fresh buffers page by page (a 23.8 ms stop at 8K tokens against a 2 ms budget). In a
    process of its own, as a worker starts: in this one, memory earlier tests freed may already be
    mapped (a cold lease faulted no page in a full run of the suite)."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", _FAULTS, str(tests)], capture_output=True, text=True,
                          cwd=tests.parent, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cold, warm = map(int, done.stdout.split())
    assert cold >= 16, (cold, warm)  # 8,192 pages of 4 KB here; 16 if the kernel backs them with 2 MB pages
    assert warm * 8 < cold, (cold, warm)


def test_a_cpu_engine_starts_with_its_longest_prompt_s_buffers_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import EngineFactory

    factory = EngineFactory(monkeypatch)
    if "model" in factory._shared:  # an earlier test's engine: its prefills' leases are not this start-up's
        factory._shared["model"][0].activations._free.clear()  # type: ignore[index]
    try:
        eng = factory(start=False, kv_capacity_tokens=4096)  # the longest prompt it can take
        assert 4096 in eng.model.activations.free_rows
    finally:
        factory.close()
