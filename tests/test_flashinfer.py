"""FlashInfer backend on a GPU (CUDA + flashinfer-python only; skipped elsewhere).

Kernels are checked against the SDPA backend in float32; the engine with FlashInfer against the
engine with SDPA on the same checkpoint; operator-level preemption on the GPU (bounded run-ahead,
suspension, resumption) against an uninterrupted run of the same plan, bit for bit.
All tests use bfloat16 and head size 128 (Llama 3's), so one set of FlashInfer kernels serves all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import flashinfer as fi_backend
from engine.attention.sdpa import SDPABackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fi_backend.available(), reason="needs CUDA and flashinfer-python (the gpu extra)"),
]
DT = torch.bfloat16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama (GQA 4:2, head size 128, llama3 RoPE) written by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
                      tie_word_embeddings=False, eos_token_id=2,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 1024})
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama-hd128")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3 (per-head q/k RMSNorm, head size 128, no bias): its q/k norms run on the fused
    RMSNorm kernel too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
                      tie_word_embeddings=True, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms off their initial ones, so a norm applied wrongly shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("qwen3-hd128")
    model.save_pretrained(path)
    return path


def splitting_cost(cfg: Any) -> Any:
    """A cost model that makes a budget of 1e-4 s split prompts into many steps and key tiles, however
    fast the GPU: what is under test is the plan's shape, not the device's speed."""
    from engine.model.cost import OpCost

    return OpCost(cfg, attn_in_s_per_row=1e-6, ffn_s_per_row=1e-6, attn_s_per_pair=1e-9, step_overhead_s=0.0)


SPLIT_BUDGET_S = 1e-4


@pytest.mark.parametrize(("causal", "n_k"), [(True, 300), (True, 1000), (False, 1000)])
def test_tiles_and_merge_match_sdpa(causal: bool, n_k: int) -> None:
    """Causal with more keys than queries: both bottom-right aligned (the queries are the last keys)."""
    torch.manual_seed(0)
    q = torch.randn(300, 8, 128, device="cuda", dtype=DT)
    k = torch.randn(n_k, 2, 128, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    fi, ref = fi_backend.FlashInferBackend(), SDPABackend()
    out, lse = fi.tile(q, k, v, causal)
    want, _ = ref.tile(q.float(), k.float(), v.float(), causal)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    if not causal:  # key tiles merged equal one tile over all keys
        parts = [fi.tile(q, k[a:b], v[a:b], False) for a, b in ((0, 200), (200, 700), (700, 1000))]
        merged = fi.merge([o for o, _ in parts], [s for _, s in parts])
        torch.testing.assert_close(merged.float(), want, atol=2e-2, rtol=2e-2)


def test_paged_decode_matches_sdpa() -> None:
    from engine.core.config import ModelConfig
    from engine.core.kv_cache import KVCache

    torch.manual_seed(0)
    cfg = ModelConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    kv = KVCache(cfg, 16, 4096, DT, "cuda")
    lengths = [1, 17, 300, 1000]
    tables = [kv.allocate(n) for n in lengths]
    for layer in range(2):
        for t, n in zip(tables, lengths, strict=True):
            keys = torch.randn(n, 2, 128, device="cuda", dtype=DT)
            kv.write(layer, kv.slots(t, 0, n), keys, torch.randn_like(keys))
    fi, ref = fi_backend.FlashInferBackend(), SDPABackend()
    for layer in range(2):  # layer 0 plans, layer 1 reuses the plan
        q = torch.randn(len(lengths), 8, 128, device="cuda", dtype=DT)
        torch.testing.assert_close(fi.decode(q, layer, kv, tables, lengths).float(),
                                   ref.decode(q, layer, kv, tables, lengths).float(), atol=2e-2, rtol=2e-2)


@contextmanager
def _engine(checkpoint: Path, backend: str) -> Iterator[Any]:
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine

    engine = Engine(EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16",
                                 attention_backend=backend, kv_block_size=16, kv_capacity_tokens=65536)).start()
    try:
        yield engine
    finally:
        engine.shutdown()


def test_auto_picks_flashinfer(checkpoint: Path) -> None:
    with _engine(checkpoint, "auto") as engine:
        assert engine.model.backend.name == "flashinfer"
        assert engine.model.kernels.name == "flashinfer"  # fused RMSNorm and SiLU-and-mul
        assert engine.model.rotary.fused  # and RoPE


@pytest.mark.parametrize("rows", [1, 7, 300, 2048])
def test_fused_row_kernels_match_torch(rows: int) -> None:
    from engine.model.kernels import TorchKernels, select_kernels

    fused, ref = select_kernels("flashinfer", torch.device("cuda"), DT, 4096, 14336), TorchKernels()
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows + 5, 4096, device="cuda", dtype=DT, generator=gen)[5:]  # a row slice, as split steps pass
    w = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=DT, generator=gen)
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=DT, generator=gen)
    for got, want in ((fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)),
                      (fused.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bfloat16: rounded once vs twice
    with pytest.raises(ValueError, match="multiples of 8"):  # 16-byte loads from each half of the row
        select_kernels("flashinfer", torch.device("cuda"), DT, 4096, 14332)


@pytest.mark.parametrize("rows", [1, 300, 2048])
def test_fused_rope_matches_torch(rows: int) -> None:
    """Llama 3.1 8B's rotation (GQA 32:8, llama3 scaling, 128K context) on column slices of a fused
    projection, at positions across the whole context."""
    from engine.model.kernels import fuse_rope
    from engine.model.rope import Rotary

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    plain, fused = (Rotary(128, 500_000.0, scaling, 131072, DT, torch.device("cuda")) for _ in range(2))
    fuse_rope(fused, 32, 8, required=True)
    assert fused.fused
    gen = torch.Generator(device="cuda").manual_seed(rows)
    qkv = torch.randn(rows, 48 * 128, device="cuda", dtype=DT, generator=gen)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    pos = torch.randint(0, 131072, (rows,), device="cuda", generator=gen)
    plain.reserve(131072)
    for got, want in zip(fused.apply(q, k, fused.rows(pos)), plain.apply(q, k, plain.rows(pos)), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # fp32 inside vs bfloat16 throughout


@pytest.mark.parametrize("model_dir", ["checkpoint", "qwen3_checkpoint"], ids=["llama", "qwen3"])
def test_engine_prefill_logits_match_sdpa_and_transformers(request: pytest.FixtureRequest, model_dir: str) -> None:
    """Last-token logits of a batch of uneven prompts (one long enough to be split into many tiles)."""
    checkpoint = request.getfixturevalue(model_dir)
    from transformers import AutoModelForCausalLM

    from engine.core.config import EngineConfig
    from engine.core.kv_cache import KVCache
    from engine.model import load_model
    from engine.model.cost import SeqSpan
    from engine.model.plan import plan_prefill
    prompts = [[i % 500 + 1 for i in range(3000)], list(range(5, 40)), [7] * 700]
    logits = {}
    for backend in ("flashinfer", "sdpa"):  # FlashInfer's attention and fused kernels; torch's throughout
        model, _ = load_model(EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16",
                                           attention_backend=backend, row_kernels=backend.replace("sdpa", "torch")))
        kv = KVCache(model.cfg, 16, 8192, DT, "cuda")
        tables = [kv.allocate(len(p)) for p in prompts]
        spans = [SeqSpan(0, len(p)) for p in prompts]
        steps = plan_prefill(splitting_cost(model.cfg), spans, SPLIT_BUDGET_S, last_token_only=True)
        assert sum(s.op == "attention" for s in steps) > 3 * len(prompts)  # many tiles, merged
        run = model.prefill(prompts, spans, tables, kv, steps)
        try:
            while True:
                next(run)
        except StopIteration as stop:
            logits[backend] = stop.value.float()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to("cuda").eval()
    with torch.inference_mode():
        want = torch.stack([hf(input_ids=torch.tensor([p], device="cuda")).logits[0, -1] for p in prompts])
    scale = want.abs().max()
    assert (logits["flashinfer"] - want).abs().max() / scale < 0.05
    assert (logits["flashinfer"] - logits["sdpa"]).abs().max() / scale < 0.05


def test_preempted_prefill_equals_uninterrupted_on_gpu(checkpoint: Path) -> None:
    """Operator-level preemption with the device's bounded run-ahead: a long prefill suspended at
    random boundaries, another batch run on the GPU in between each time, then resumed, gives the
    same logits bit for bit as the same plan run straight through; every KV block comes back."""
    import random

    from engine.core.config import EngineConfig
    from engine.core.kv_cache import KVCache
    from engine.core.prefill import PrefillBatch
    from engine.core.request import Request
    from engine.model import load_model
    from engine.model.cost import SeqSpan

    model, _ = load_model(EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16",
                                       attention_backend="flashinfer"))
    cost = splitting_cost(model.cfg)
    kv = KVCache(model.cfg, 16, 16384, DT, "cuda")

    def batch(rid: str, n: int, seed: int) -> PrefillBatch:
        gen = torch.Generator().manual_seed(seed)
        req = Request(request_id=rid, prompt_token_ids=torch.randint(0, 512, (n,), generator=gen).tolist())
        req.block_table = kv.allocate(n)
        return PrefillBatch.on_model([req], [SeqSpan(0, n)], model, kv, cost, SPLIT_BUDGET_S)

    def finish(b: PrefillBatch) -> torch.Tensor:
        while not b.advance():
            pass
        kv.free(b.head.block_table)
        assert b.logits is not None
        return b.logits

    straight = finish(batch("a", 4000, 1))
    deterministic = torch.equal(finish(batch("a", 4000, 1)), straight)  # FlashInfer's kernels are, by design
    rng = random.Random(0)
    long = batch("a", 4000, 1)
    n_steps, suspended = len(long.steps), 0
    stops = sorted(rng.sample(range(1, n_steps - 1), 12))
    for stop in stops:
        while long.next_step < stop:
            long.advance()
        queued_steps, queued_s = long.wait_device()
        assert queued_steps >= 1 and queued_s > 0  # the run-ahead always leaves the newest step queued
        suspended += 1
        finish(batch(f"urgent-{stop}", 64, stop))  # another batch takes the device meanwhile
    resumed = finish(long)
    assert suspended == 12
    if deterministic:
        assert torch.equal(resumed, straight)
    else:  # then at least as close as two straight runs are
        torch.testing.assert_close(resumed, straight, atol=1e-2, rtol=1e-2)
    assert deterministic, "two identical runs differed: the bit-for-bit check above was relaxed"
    assert kv.num_free_blocks == kv.num_blocks


def test_engine_serves_with_flashinfer_and_frees_everything(checkpoint: Path) -> None:
    """Prefill + decode through the engine (paged decode kernel), greedy, KV pool whole afterwards.
    Greedy ids of the two backends agree on the first tokens (bf16 rounding may flip a near-tie later)."""
    from engine.core.request import SamplingParams

    prompts = [list(range(1, 300)), list(range(5, 40)), [3] * 1500]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = {}
    for backend in ("flashinfer", "sdpa"):
        with _engine(checkpoint, backend) as engine:
            results[backend] = [r.output_token_ids for r in engine.generate(prompts, params)]
            assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(len(ids) == 8 for ids in results["flashinfer"])
    assert [ids[0] for ids in results["flashinfer"]] == [ids[0] for ids in results["sdpa"]]


@pytest.mark.parametrize("budget_s", [None, SPLIT_BUDGET_S])
@pytest.mark.parametrize("long", [2000, 1000], ids=["eager", "graphs"])
def test_no_step_waits_for_the_gpu(checkpoint: Path, budget_s: float | None, long: int) -> None:
    """The rule that keeps a GPU fed: nothing inside a prefill step reads device data on the host
    (which would wait for every queued kernel). torch's sync debug mode raises on any such read; the
    batch set-up (before the first step's yield) and the logits (after the last's) may sync and run
    outside it. 2,300 tokens run eagerly, 1,300 replay CUDA graphs (the first run captures them)."""
    from engine.core.config import EngineConfig
    from engine.core.kv_cache import KVCache
    from engine.model import load_model
    from engine.model.cost import SeqSpan
    from engine.model.plan import plan_prefill
    model, _ = load_model(EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16",
                                       attention_backend="flashinfer"))
    cost = splitting_cost(model.cfg)
    kv = KVCache(model.cfg, 16, 8192, DT, "cuda")
    prompts = [[i % 500 + 1 for i in range(long)], [5] * 300]
    spans = [SeqSpan(0, len(p)) for p in prompts]
    steps = plan_prefill(cost, spans, budget_s, last_token_only=True)
    tables = [kv.allocate(len(p)) for p in prompts]
    for _ in model.prefill(prompts, spans, tables, kv, steps):  # first calls: kernels loaded, tables cached
        pass
    run = model.prefill(prompts, spans, tables, kv, steps)
    next(run)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(len(steps) - 1):  # every step after the first
            next(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(StopIteration):
        next(run)
    assert model.graphs is not None and model.graphs.captured == ([1408] if long == 1000 else [])


def test_cuda_graphs_match_the_eager_forward(checkpoint: Path) -> None:
    """Batches of up to `cuda_graph_tokens` replay their row-wise steps as CUDA graphs: logits equal
    the eager forward's to bfloat16 rounding, unsplit and split, bit for bit repeatable; a batch
    suspended on its bucket while another of that bucket runs (eagerly) and one of another bucket
    runs (its own graphs) resumes to the same logits; every lease comes back."""
    from engine.core.config import EngineConfig
    from engine.core.kv_cache import KVCache
    from engine.core.prefill import PrefillBatch
    from engine.core.request import Request
    from engine.model import load_model
    from engine.model.cost import SeqSpan

    def cfg(graph_tokens: int) -> EngineConfig:
        return EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                            cuda_graph_tokens=graph_tokens)

    graphed, eager = load_model(cfg(2048))[0], load_model(cfg(0))[0]
    assert graphed.graphs is not None and eager.graphs is None
    cost = splitting_cost(graphed.cfg)
    kv = KVCache(graphed.cfg, 16, 16384, DT, "cuda")

    def batch(model: Any, lengths: list[int], budget: float | None, seed: int) -> PrefillBatch:
        gen = torch.Generator().manual_seed(seed)
        reqs = []
        for i, n in enumerate(lengths):
            r = Request(request_id=f"{seed}-{i}", prompt_token_ids=torch.randint(0, 512, (n,), generator=gen).tolist())
            r.block_table = kv.allocate(n)
            reqs.append(r)
        return PrefillBatch.on_model(reqs, [SeqSpan(0, n) for n in lengths], model, kv, cost, budget)

    def finish(b: PrefillBatch) -> torch.Tensor:
        while not b.advance():
            pass
        for r in b.requests:
            kv.free(r.block_table)
        assert b.logits is not None
        return b.logits.float()

    for budget in (None, SPLIT_BUDGET_S):
        lengths = [700, 35, 300]  # 1035 tokens: the 1152 bucket
        want = finish(batch(eager, lengths, budget, 1))
        got = finish(batch(graphed, lengths, budget, 1))
        assert (got - want).abs().max() / want.abs().max() < 0.02
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert torch.equal(finish(batch(graphed, lengths, budget, 1)), got)
        assert graphed.graphs.failure is None and graphed.graphs.captured == [1152]

    straight = finish(batch(graphed, [1000], None, 2))
    held = batch(graphed, [1000], None, 2)
    for _ in range(4):
        held.advance()
    held.wait_device()
    same_bucket = finish(batch(graphed, [1010], None, 3))  # the 1024 bucket is held: eager
    torch.testing.assert_close(same_bucket, finish(batch(eager, [1010], None, 3)), atol=0.05, rtol=0.05)
    finish(batch(graphed, [64], None, 4))
    assert torch.equal(finish(held), straight)
    assert graphed.graphs is not None and not any(b.leased for b in graphed.graphs._buckets.values())
    assert kv.num_free_blocks == kv.num_blocks
