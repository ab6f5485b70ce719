"""Reference correctness: our operator-step forward against transformers on the same weights (fp32).

Every prompt of a ragged batch must give transformers' logits (max |err| / max |ref| <= 1e-4), whether
the prefill runs one step per operator or is split into many small tiles/blocks, whether the prompt is
prefilled whole or in chunks over a paged KV cache, and greedy decoding through the real Engine must
give transformers' `generate` token for token.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import VARIANTS, load_reference

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.kv_cache import KVCache
from engine.core.request import Request, SamplingParams, TokenOutput
from engine.model import LlamaModel, load_model
from engine.model.calibration import calibrate
from engine.model.cost import ATTENTION, FFN_IN, MLP, OpCost, SeqSpan, Step
from engine.model.loader import load_checkpoint, save_checkpoint, tiny_model
from engine.model.plan import plan_prefill

pytest.importorskip("transformers")  # the reference (a dev dependency)

RTOL = 1e-4
TINY_BUDGET_S = 1e-5  # far below any step's cost: forces the smallest tiles and row blocks
PROMPT_LENS = (1, 5, 33, 70, 131)  # one ragged batch: single token, < one block, several blocks
GEN_PROMPT_LENS = (3, 17, 40)
GEN_TOKENS = 16

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _prompts(lens: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def _drain(gen: Generator[int, None, torch.Tensor], n_steps: int) -> torch.Tensor:
    done = []
    while True:
        try:
            done.append(next(gen))
        except StopIteration as stop:
            assert done == list(range(n_steps)), "prefill must yield each step's index once, in order"
            return stop.value


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@torch.no_grad()
def _reference_logits(ref: Any, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0].float()


class _Paged:
    """A KV cache whose blocks are handed out in a scrambled order (so slot mapping is exercised)."""

    def __init__(self, model: LlamaModel, lens: list[int], block_size: int = 16, seed: int = 0) -> None:
        need = [-(-n // block_size) for n in lens]
        self.kv = KVCache(model.cfg, block_size, sum(need) * block_size, model.embed.dtype, model.device)
        blocks = self.kv.allocate(sum(need) * block_size)
        random.Random(seed).shuffle(blocks)
        self.tables, i = [], 0
        for n in need:
            self.tables.append(blocks[i : i + n])
            i += n


def _prefill(model: LlamaModel, cost: OpCost, paged: _Paged, token_ids: list[list[int]], spans: list[SeqSpan],
             budget_s: float | None, tables: list[list[int]] | None = None) -> tuple[torch.Tensor, Sequence[Step]]:
    steps = plan_prefill(cost, spans, budget_s)
    tables = paged.tables if tables is None else tables
    with torch.inference_mode():
        logits = _drain(model.prefill(token_ids, spans, tables, paged.kv, steps, all_logits=True), len(steps))
    return logits, steps


@dataclass
class Loaded:
    name: str
    path: Path
    model: LlamaModel
    cost: OpCost
    ref: Any


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def loaded(request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]) -> Loaded:
    path = tiny_checkpoint(request.param)
    model, _ = load_model(EngineConfig(model=str(path)))
    return Loaded(request.param, path, model, calibrate(model), load_reference(path))


# -- prefill ---------------------------------------------------------------------------------

MODES = ["unsplit", "split", "split_min"]


def _plan_inputs(loaded: Loaded, mode: str) -> tuple[OpCost, float | None]:
    """unsplit: one step per operator. split: the calibrated cost model under a tiny budget.
    split_min: a cost model that calls every row and key expensive, so the tiny budget gives the
    smallest blocks on any machine (32-row blocks, 32-query blocks, 128-key tiles)."""
    if mode == "unsplit":
        return loaded.cost, None
    if mode == "split":
        return loaded.cost, TINY_BUDGET_S
    slow = dataclasses.replace(loaded.cost, attn_in_s_per_row=1e-3, ffn_s_per_row=1e-3, attn_s_per_pair=1e-3)
    return slow, TINY_BUDGET_S


@pytest.mark.parametrize("mode", MODES)
def test_prefill_matches_transformers(loaded: Loaded, mode: str) -> None:
    m = loaded.model
    cost, budget_s = _plan_inputs(loaded, mode)
    prompts = _prompts(PROMPT_LENS, m.cfg.vocab_size, seed=len(loaded.name))
    spans = [SeqSpan(0, len(p)) for p in prompts]
    logits, steps = _prefill(m, cost, _Paged(m, [len(p) for p in prompts]), prompts, spans, budget_s)

    layers = m.cfg.num_hidden_layers
    if mode == "unsplit":  # one step per operator: attn_in, one causal tile per sequence, ffn; the head
        assert len(steps) == layers * (2 + len(prompts)) + 1
    if mode == "split_min":  # the sub-operator split really happened
        assert {b - a for _, op, (a, b), *_ in steps if op != ATTENTION} <= set(range(1, 33))
        assert {b - a for _, op, (a, b), *_ in steps if op == ATTENTION} <= set(range(1, 33))
        assert len(steps) > 4 * layers * (2 + len(prompts))

    assert logits.shape == (sum(PROMPT_LENS), m.cfg.vocab_size)
    row = 0
    for ids in prompts:
        ours, ref = logits[row : row + len(ids)], _reference_logits(loaded.ref, ids)
        row += len(ids)
        err = _rel_err(ours, ref)
        assert err <= RTOL, f"{loaded.name}: prompt of {len(ids)} tokens"


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_matches_transformers(loaded: Loaded, mode: str) -> None:
    """A prompt prefilled in two chunks (the second attends to the first through the paged cache),
    batched with a fresh prompt, equals transformers on the whole prompt."""
    m = loaded.model
    cost, budget_s = _plan_inputs(loaded, mode)
    long, fresh = _prompts((150, 20), m.cfg.vocab_size, seed=7)
    first = 70
    paged = _Paged(m, [len(long), len(fresh)], seed=1)
    head, _ = _prefill(m, cost, paged, [long[:first]], [SeqSpan(0, first)], budget_s, paged.tables[:1])
    logits, steps = _prefill(m, cost, paged, [long[first:], fresh],
                             [SeqSpan(first, len(long) - first), SeqSpan(0, len(fresh))], budget_s)
    prefix_tiles = [s for s in steps if s.op == ATTENTION and not s.causal]
    assert all(s.seq == 0 for s in prefix_tiles)
    # the chunk's queries read the cached prefix: a tile of it, or one causal step over every key
    assert any(s.keys[0] == 0 for s in steps if s.op == ATTENTION and s.seq == 0)
    if mode == "unsplit":
        assert [s.keys for s in steps if s.op == ATTENTION and s.seq == 0 and s.layer == 0] == [(0, len(long))]
    if mode == "split_min":  # several query blocks, over one or several 128-key tiles of the cached prefix
        assert {s.keys for s in prefix_tiles} >= {(0, 70), (0, 128), (128, 134)}

    ref_long, ref_fresh = _reference_logits(loaded.ref, long), _reference_logits(loaded.ref, fresh)
    errs = {"first chunk": _rel_err(head, ref_long[:first]),
            "second chunk": _rel_err(logits[: len(long) - first], ref_long[first:]),
            "fresh prompt": _rel_err(logits[len(long) - first :], ref_fresh)}
    assert max(errs.values()) <= RTOL, f"{loaded.name}: {errs}"


def test_mlp_sliced_prefill_matches_transformers(loaded: Loaded) -> None:
    """The FFN cut by the MLP's intermediate columns as well as by rows (FFN_IN and MLP steps, what
    SmolLM2-135M's prefill runs at the 2 ms budget on a CPU core), gate/up interleaved by slice."""
    cfg, weights = load_checkpoint(loaded.path)
    m = LlamaModel(cfg, weights, loaded.model.backend, linear=type(loaded.model.layers[0].qkv), slices=2)
    m.kernels = loaded.model.kernels
    cost = dataclasses.replace(loaded.cost, ffn_s_per_row=1e-3, mlp_slices=2, ffn_in_s_per_row=1e-6,
                               mlp_s_per_row=1e-6)
    prompts = _prompts(PROMPT_LENS, m.cfg.vocab_size, seed=len(loaded.name))
    spans = [SeqSpan(0, len(p)) for p in prompts]
    logits, steps = _prefill(m, cost, _Paged(m, [len(p) for p in prompts]), prompts, spans, TINY_BUDGET_S)
    assert {s.op for s in steps} >= {FFN_IN, MLP}
    row = 0
    for ids in prompts:
        ours, ref = logits[row : row + len(ids)], _reference_logits(loaded.ref, ids)
        row += len(ids)
        assert _rel_err(ours, ref) <= RTOL, f"{loaded.name}: prompt of {len(ids)} tokens"


def test_last_token_logits(loaded: Loaded) -> None:
    """Without all_logits, prefill returns each sequence's last-token row."""
    m = loaded.model
    prompts = _prompts((4, 9, 2), m.cfg.vocab_size, seed=3)
    spans = [SeqSpan(0, len(p)) for p in prompts]
    paged = _Paged(m, [len(p) for p in prompts])
    steps = plan_prefill(loaded.cost, spans, TINY_BUDGET_S)
    with torch.inference_mode():
        last = _drain(m.prefill(prompts, spans, paged.tables, paged.kv, steps), len(steps))
    assert last.shape == (len(prompts), m.cfg.vocab_size)
    errs = [_rel_err(last[i], _reference_logits(loaded.ref, ids)[-1]) for i, ids in enumerate(prompts)]
    assert max(errs) <= RTOL, f"{loaded.name}: {errs}"


# -- decode: greedy through the real engine ------------------------------------------------------

@pytest.mark.timeout(120)  # a lost request would block generate() forever
def test_engine_greedy_matches_transformers_generate(loaded: Loaded) -> None:
    m = loaded.model
    prompts = _prompts(GEN_PROMPT_LENS, m.cfg.vocab_size, seed=11)
    cfg = EngineConfig(model=str(loaded.path), kv_capacity_tokens=4096, kv_block_size=16, num_threads=1)
    engine = Engine(cfg).start()
    try:
        reqs = engine.generate(prompts, SamplingParams(max_tokens=GEN_TOKENS, temperature=0, ignore_eos=True))
    finally:
        engine.shutdown()

    ref = loaded.ref
    ref.generation_config.eos_token_id = None  # ignore_eos: both sides generate all GEN_TOKENS
    for ids, req in zip(prompts, reqs, strict=True):
        assert req.finish_reason == "length", req.finish_reason
        with torch.no_grad():
            x = torch.tensor([ids])
            out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=GEN_TOKENS)
        expected = out[0, len(ids) :].tolist()
        assert len(expected) == GEN_TOKENS
        assert req.output_token_ids == expected, f"{loaded.name}: prompt of {len(ids)} tokens"


def test_repetition_penalty_and_logprobs_match_transformers_generate(loaded: Loaded) -> None:
    """Greedy with HF's repetition penalty (on prompt and output tokens), and each token's logprob and
    top 5 under the raw logits (transformers' `output_logits`), token for token."""
    m = loaded.model
    prompts = _prompts((9, 100), m.cfg.vocab_size, seed=12)  # 100: about half the vocabulary penalised
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.8, logprobs=5)
    engine = Engine(EngineConfig(model=str(loaded.path), kv_capacity_tokens=4096, kv_block_size=16,
                                 num_threads=1)).start()
    outputs: list[list[TokenOutput]] = [[] for _ in prompts]
    try:
        for i, ids in enumerate(prompts):
            done = threading.Event()
            r = Request(request_id=f"lp{i}", prompt_token_ids=ids, sampling=params)
            r.sink = lambda out, i=i, done=done: (outputs[i].append(out), out.finish_reason and done.set())
            engine.add_request(r)
            assert done.wait(60)
    finally:
        engine.shutdown()
    changed = 0
    for ids, outs in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            x = torch.tensor([ids])
            ref = loaded.ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                                      repetition_penalty=1.8, eos_token_id=None, output_logits=True,
                                      return_dict_in_generate=True)
        expected = ref.sequences[0, len(ids):].tolist()
        assert [t for o in outs for t in o.token_ids] == expected
        unpenalized = loaded.ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                                          eos_token_id=None)[0, len(ids):].tolist()
        changed += expected != unpenalized
        got = [lp for o in outs for lp in o.logprobs or []]
        assert len(got) == 8
        for entry, token, logits in zip(got, expected, ref.logits, strict=True):
            want = torch.log_softmax(logits[0].float(), -1)
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
            top = want.topk(5)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert changed, "the penalty must change some greedy output, or this test checks nothing"


def test_prompt_logprobs_match_transformers(loaded: Loaded) -> None:
    """Completions' echo with logprobs: every prompt token's log-probability and top 3 under the
    logits of the position before it, as transformers' forward gives them; also when the prompt is
    prefilled in chunks, and never from the prefix cache."""
    prompts = _prompts((9, 150), loaded.model.cfg.vocab_size, seed=13)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    for policy in ("flowprefill", "chunked:32"):
        engine = Engine(EngineConfig(model=str(loaded.path), kv_capacity_tokens=4096, kv_block_size=16,
                                     num_threads=1), policy).start()
        try:
            engine.generate(prompts, SamplingParams(max_tokens=1))  # cached, then not used
            reqs = engine.generate(prompts, params)
        finally:
            engine.shutdown()
        for ids, req in zip(prompts, reqs, strict=True):
            assert req.cached_tokens == 0 and req.prompt_token_logprobs[0] is None
            got = req.prompt_token_logprobs[1:]
            assert len(got) == len(ids) - 1
            with torch.no_grad():
                want = torch.log_softmax(loaded.ref(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            for p, entry in enumerate(got):
                assert entry is not None and entry.token_id == ids[p + 1]
                assert entry.logprob == pytest.approx(float(want[p, ids[p + 1]]), abs=1e-4), (policy, p)
                assert [t for t, _ in entry.top] == want[p].topk(3).indices.tolist()


# -- the embedded tiny model --------------------------------------------------------------------

def test_tiny_model_saves_a_transformers_checkpoint(tmp_path: Path) -> None:
    cfg, weights = tiny_model(seed=0)
    save_checkpoint(cfg, weights, tmp_path)

    cfg2, weights2 = load_checkpoint(tmp_path)  # round trip through our own loader
    assert (cfg2.vocab_size, cfg2.hidden_size, cfg2.num_hidden_layers, cfg2.rope_theta, cfg2.eos_token_id) == (
        cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rope_theta, cfg.eos_token_id)
    assert weights2.keys() == weights.keys()
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)

    ref = load_reference(tmp_path)  # transformers reads it, with no missing or unexpected tensors
    assert sum(p.numel() for p in ref.parameters()) == sum(w.numel() for w in weights.values())
    embedded, _ = load_model(EngineConfig())  # model "tiny": the embedded model, same seed
    from_dir, _ = load_model(EngineConfig(model=str(tmp_path)))
    prompts = _prompts((6, 40), cfg.vocab_size, seed=5)
    spans = [SeqSpan(0, len(p)) for p in prompts]
    for model in (embedded, from_dir):
        cost = calibrate(model)
        for budget_s in (None, TINY_BUDGET_S):
            logits, _ = _prefill(model, cost, _Paged(model, [len(p) for p in prompts]), prompts, spans, budget_s)
            errs = [_rel_err(logits[:6], _reference_logits(ref, prompts[0])),
                    _rel_err(logits[6:], _reference_logits(ref, prompts[1]))]
            assert max(errs) <= RTOL, f"budget {budget_s}: {errs}"
