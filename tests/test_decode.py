"""Decode: OutputStream (stop strings, EOS, length, ignore_eos), sampling, and the paged-KV decode
path checked against prefill by teacher forcing."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import EngineFactory, drain

import engine.core.decode as decode_module
import engine.core.outputs as outputs_module
from engine.attention.sdpa import SDPABackend
from engine.core.config import ModelConfig
from engine.core.decode import OutputStream
from engine.core.engine import Engine
from engine.core.kv_cache import KVCache
from engine.core.request import Request, Sampled, SamplingParams, TokenOutput
from engine.core.sampling import draw, draw_among, nucleus
from engine.core.sampling import sample as sample_with_logprobs
from engine.core.tokenizer import ByteTokenizer
from engine.model.cost import OpCost, SeqSpan
from engine.model.llama import LlamaModel
from engine.model.loader import expected_shapes
from engine.model.plan import plan_prefill

BYTES = ByteTokenizer(512)
EOS = BYTES.eos_token_ids[0]


def make_req(rid: str = "r", **sampling: object) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


class PieceTokenizer:
    """Multi-character tokens: token i decodes to pieces[i] (no byte-level buffering)."""

    def __init__(self, pieces: list[str], eos: tuple[int, ...] = ()) -> None:
        self.pieces, self.eos_token_ids = pieces, list(eos)

    def incremental_decoder(self) -> PieceTokenizer:
        return self

    def push(self, token_id: int) -> str:
        return self.pieces[token_id]


def stream(req: Request, token_ids: list[int], tokenizer: object = BYTES) -> list[TokenOutput]:
    """Push tokens until the stream finishes; every output is checked to carry its token."""
    s = OutputStream(req, tokenizer)  # type: ignore[arg-type]
    outs = []
    for t in token_ids:
        out = s.push(Sampled(t))
        assert out.token_ids == [t] and out.request_id == req.request_id
        outs.append(out)
        if out.finish_reason:
            break
    return outs


def joined(outs: list[TokenOutput]) -> str:
    return "".join(o.text for o in outs)


def assert_no_stop_shown(outs: list[TokenOutput], stops: list[str]) -> None:
    text = ""
    for o in outs:
        text += o.text
        assert not any(s in text for s in stops), f"stop string streamed: {text!r}"


# -- OutputStream --------------------------------------------------------------------------------

def test_stop_string_is_never_streamed() -> None:
    req = make_req(stop=["STOP"], max_tokens=100)
    outs = stream(req, list(b"hello STOP world"))
    assert joined(outs) == "hello "
    assert outs[-1].finish_reason == "stop"
    assert len(outs) == len("hello STOP")  # finished on the token that completed the stop string
    assert all(o.finish_reason is None for o in outs[:-1])
    assert_no_stop_shown(outs, ["STOP"])
    # the held-back prefix is not shown early: after "hello S", only "hello " was out
    assert joined(outs[:7]) == "hello "
    assert req.output_token_ids == list(b"hello STOP")


def test_false_start_of_a_stop_string_is_released() -> None:
    req = make_req(stop=["STOP"], max_tokens=100)
    outs = stream(req, list(b"a STa STOx STOP z"))
    assert joined(outs) == "a STa STOx "
    assert outs[-1].finish_reason == "stop"
    assert_no_stop_shown(outs, ["STOP"])


def test_stop_split_across_multi_character_tokens() -> None:
    tok = PieceTokenizer(["he", "llo S", "TO", "P wor", "ld", "xx"])
    req = make_req(stop=["STOP"], max_tokens=100)
    outs = stream(req, [0, 1, 2, 3, 4], tok)
    assert [o.text for o in outs] == ["he", "llo ", "", ""]
    assert outs[-1].finish_reason == "stop"
    # a token that holds the whole stop string and more
    req = make_req(stop=["lo S"], max_tokens=100)
    outs = stream(req, [0, 1, 2], tok)
    assert joined(outs) == "hel" and outs[-1].finish_reason == "stop" and len(outs) == 2


def test_earliest_of_several_stop_strings() -> None:
    tok = PieceTokenizer(["ab", "cdef", "g"])
    req = make_req(stop=["def", "cd", "zz"], max_tokens=10)
    outs = stream(req, [0, 1, 2], tok)
    assert joined(outs) == "ab" and outs[-1].finish_reason == "stop"


def test_stop_with_multibyte_utf8() -> None:
    req = make_req(stop=["é!"], max_tokens=100)
    outs = stream(req, list("ça é va é!".encode()))
    assert joined(outs) == "ça é va "
    assert outs[-1].finish_reason == "stop"
    assert all("\ufffd" not in o.text for o in outs), "a half character was streamed"


def test_eos_finishes_with_stop_and_flushes_held_text() -> None:
    req = make_req(stop=["i!"], max_tokens=100)
    outs = stream(req, [*b"hi", EOS, *b"more"])
    assert joined(outs) == "hi"  # "i" was held (a prefix of "i!"), EOS releases it
    assert [o.finish_reason for o in outs] == [None, None, "stop"]
    assert req.output_token_ids == [*b"hi", EOS]
    # every EOS id of the tokenizer counts
    for eos in BYTES.eos_token_ids:
        outs = stream(make_req(max_tokens=10), [65, eos])
        assert outs[-1].finish_reason == "stop" and joined(outs) == "A"


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = make_req(ignore_eos=True, max_tokens=5)
    outs = stream(req, [65, EOS, 66, EOS, 67, 68])
    assert [o.finish_reason for o in outs] == [None, None, None, None, "length"]
    assert joined(outs) == "ABC"  # a special token has no text
    assert req.output_token_ids == [65, EOS, 66, EOS, 67]


def test_max_tokens_is_length_and_flushes_held_text() -> None:
    req = make_req(stop=["xyz"], max_tokens=4)
    outs = stream(req, list(b"abxyz"))
    assert [o.finish_reason for o in outs] == [None, None, None, "length"]
    assert joined(outs) == "abxy"  # "xy" was held as a possible stop, the length limit shows it
    outs = stream(make_req(max_tokens=1), [70, 71])
    assert len(outs) == 1 and outs[0].finish_reason == "length" and outs[0].text == "F"
    # a stop string completed on the last allowed token is a stop, not a length finish
    outs = stream(make_req(stop=["cd"], max_tokens=4), list(b"abcd"))
    assert outs[-1].finish_reason == "stop" and joined(outs) == "ab"


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_random_streams(seed: int) -> None:
    """Random pieces (some empty) over a two-letter alphabet against a direct reference."""
    rng = random.Random(seed)
    for _ in range(150):
        pieces = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 3))) for _ in range(8)]
        tok = PieceTokenizer(pieces)
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        max_tokens = rng.randint(1, 12)
        ids = [rng.randrange(len(pieces)) for _ in range(12)]
        # reference: the finish comes at the first token whose text completes a stop string
        text, want_text, want_reason, want_n = "", None, None, None
        for n, t in enumerate(ids, 1):
            text += pieces[t]
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                want_text, want_reason, want_n = text[: min(hits)], "stop", n
                break
            if n >= max_tokens:
                want_text, want_reason, want_n = text, "length", n
                break
        req = make_req(stop=stops, max_tokens=max_tokens)
        outs = stream(req, ids, tok)
        ctx = (pieces, stops, max_tokens, ids)
        assert (joined(outs), outs[-1].finish_reason, len(outs)) == (want_text, want_reason, want_n), ctx
        assert_no_stop_shown(outs, stops)


# -- sampling ------------------------------------------------------------------------------------

def sample(logits: torch.Tensor, reqs: list[Request], gens: dict[str, torch.Generator]) -> list[int]:
    """The sampled token ids (tests/test_sampling.py checks penalties and logprobs)."""
    out = sample_with_logprobs(logits, reqs, gens)
    assert all(isinstance(s, Sampled) for s in out)
    return [s.token for s in out]  # type: ignore[union-attr]


def logits_rows(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 0.0, "top_k": 5, "top_p": 0.5, "seed": 3},
    {"temperature": 1.5, "top_k": 1},
    {"temperature": 1.0, "top_p": 1e-6},
    {"temperature": 1.0, "top_p": 1e-6, "top_k": 10, "seed": 9},
])
def test_greedy_equivalents(params: dict[str, object]) -> None:
    logits = logits_rows()
    reqs = [make_req(f"r{i}", **params) for i in range(len(logits))]
    for trial in range(10):
        torch.manual_seed(trial)
        assert sample(logits, reqs, {}) == logits.argmax(-1).tolist()


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p by a stable sort of the whole vocabulary (what `nucleus` must equal: ties by id), as a vector."""
    sorted_p, order = probs.sort(descending=True, stable=True)
    drop = sorted_p.cumsum(0) - sorted_p >= top_p
    drop[0] = False
    return probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))


@pytest.mark.parametrize("vocab", [5, 50, 600, 49152])
def test_nucleus_is_the_sorted_vocabularys_and_draws_the_same_id(vocab: int) -> None:
    """`nucleus` looks among the top k only, k grown until the set ends inside them: the same ids and
    probabilities as sorting everything, from peaked to flat distributions; `draw_among` over them
    draws the id `draw` would over the whole vocabulary, for the same generator state."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [torch.softmax(torch.randn(vocab, generator=gen) * scale, -1) for scale in (0.3, 2.0, 8.0, 30.0)]
    # a bf16 model's logits: runs of equal probabilities, which the cut often falls inside
    rows += [torch.softmax((torch.randn(vocab, generator=gen) * s + 10).bfloat16().float(), -1) for s in (1.0, 3.0)]
    tied = torch.zeros(vocab)
    tied[torch.randperm(vocab, generator=gen)[: max(2, vocab // 4)]] = 1.0  # one run of equal ids, at the top
    rows.append(tied / tied.sum())
    for probs in rows:
        for top_p in (1e-9, 0.1, 0.3, 0.9, 0.95, 0.999):
            ids, kept = nucleus(probs, top_p)
            want = _sorted_nucleus(probs, top_p)
            assert torch.equal(torch.zeros_like(probs).scatter_(0, ids, kept), want), top_p
            for seed in range(3):
                assert draw_among(ids, kept, torch.Generator().manual_seed(seed)) == \
                    draw(want, torch.Generator().manual_seed(seed))


def test_seed_determinism_and_independence() -> None:
    logits = torch.zeros(1, 100)  # uniform: every draw is up to the generator

    def draws(seed: int | None, gens: dict[str, torch.Generator], n: int = 30, rid: str = "s") -> list[int]:
        req = make_req(rid, temperature=1.0, seed=seed)
        return [sample(logits, [req], gens)[0] for _ in range(n)]

    a = draws(5, {})
    assert a == draws(5, {})
    assert a != draws(6, {})
    assert len(set(a)) > 5, "the per-request generator must advance between tokens"
    # two requests with the same seed in one batch draw the same tokens (own generators)
    gens: dict[str, torch.Generator] = {}
    pair = [make_req("x", temperature=1.0, seed=5), make_req("y", temperature=1.0, seed=5)]
    rows = [sample(torch.zeros(2, 100), pair, gens) for _ in range(30)]
    assert [r[0] for r in rows] == [r[1] for r in rows] == a
    # seed=None draws from the global generator
    torch.manual_seed(1)
    u = draws(None, {})
    torch.manual_seed(1)
    assert u == draws(None, {})


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = logits_rows(1, 40, seed=3)[0]
    top3 = set(logits.topk(3).indices.tolist())
    gens: dict[str, torch.Generator] = {}
    req = make_req("k", temperature=5.0, top_k=3, seed=0)  # hot: without the cut, anything goes
    got = {sample(logits[None], [req], gens)[0] for _ in range(300)}
    assert got <= top3 and len(got) >= 2

    probs = torch.tensor([0.6, 0.3, 0.1])
    req = make_req("p", temperature=1.0, top_p=0.7, seed=0)
    got = {sample(probs.log()[None], [req], gens)[0] for _ in range(300)}
    assert got == {0, 1}, "top_p=0.7 keeps the smallest set reaching 0.7: the first two"

    # A top_p too small for float32 (it rounds to 0) still keeps the likeliest token: it once left no
    # token at all and the request failed with an internal error (found by tests/test_schemathesis.py).
    req = make_req("tiny", temperature=1.0, top_p=3.4e-254, seed=0)
    assert {sample(probs.log()[None], [req], gens)[0] for _ in range(20)} == {0}
    # Likewise a temperature whose division overflows float32: greedy below 1e-5.
    req = make_req("cold", temperature=2.9862795153550757e-76, top_k=118042, seed=0)
    assert sample(logits[None], [req], gens) == [int(logits.argmax())]

    req = make_req("t", temperature=1e-3, seed=0)  # a near-zero temperature is almost greedy
    assert all(sample(logits_rows(4, 40, seed=s), [req] * 4, {}) == logits_rows(4, 40, seed=s).argmax(-1).tolist()
               for s in range(5))


# -- the paged decode path ---------------------------------------------------------------------------

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                   eos_token_id=[0], name="tiny-decode")


def test_model_decode_matches_prefill_logits() -> None:
    """Prefill prompts, then decode known tokens batched over 4-token KV blocks: each step's logits
    equal the logits a single prefill over prompt + continuation gives at that position."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        weights = {name: (1.0 + 0.1 * torch.randn(shape, generator=gen)) if name.endswith("norm.weight")
                   else torch.randn(shape, generator=gen) * 0.1 for name, shape in expected_shapes(TINY).items()}
        model = LlamaModel(TINY, weights, SDPABackend())
        cost = OpCost(TINY, 1e-6, 1e-6, 1e-8, 0.0)
        lengths, steps_n = [1, 6, 13], 9
        seqs = [torch.randint(1, TINY.vocab_size, (n + steps_n,), generator=gen).tolist() for n in lengths]

        kv = KVCache(TINY, 4, 256, torch.float32, "cpu")
        tables = [kv.allocate(len(s)) for s in seqs]
        spans = [SeqSpan(0, n) for n in lengths]
        last = drain(model.prefill([s[:n] for s, n in zip(seqs, lengths, strict=True)], spans, tables, kv,
                                   plan_prefill(cost, spans, 5e-5)))
        decoded = [last]
        for j in range(steps_n - 1):
            decoded.append(model.decode([s[n + j] for s, n in zip(seqs, lengths, strict=True)],
                                        [n + j for n in lengths], tables, kv))
        for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
            ref_kv = KVCache(TINY, 4, 256, torch.float32, "cpu")
            full = [SeqSpan(0, len(s) - 1)]
            ref = drain(model.prefill([s[:-1]], full, [ref_kv.allocate(len(s))], ref_kv,
                                      plan_prefill(cost, full, None), all_logits=True))
            got = torch.stack([d[i] for d in decoded])
            torch.testing.assert_close(got, ref[n - 1 :], rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineFactory]:
    factory = EngineFactory(monkeypatch, kv_capacity_tokens=16384, kv_block_size=64)
    yield factory
    factory.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def test_engine_decode_equals_teacher_forced_prefill(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine()
    prompts = [prompt(n, n) for n in (3, 17, 40, 64)]  # decode crosses 16-token KV blocks
    reqs = eng.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    model, kv = eng.model, eng.kv
    assert kv.num_free_blocks == kv.num_blocks
    cost = eng.cost
    for req, ids in zip(reqs, prompts, strict=True):
        out = req.output_token_ids
        assert req.finish_reason == "length" and len(out) == 30
        seq = ids + out[:-1]

        def teacher_forced(seq: list[int] = seq) -> torch.Tensor:  # on the engine thread: it owns the KV
            table = kv.allocate(len(seq))
            span = [SeqSpan(0, len(seq))]
            logits = drain(model.prefill([seq], span, [table], kv, plan_prefill(cost, span, None), all_logits=True))
            kv.free(table)
            return logits

        logits = eng.call(teacher_forced)
        assert logits[len(ids) - 1 :].argmax(-1).tolist() == out, "decode diverged from prefill over the same tokens"


def test_engine_seeded_sampling_is_reproducible(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine()
    p = prompt(20, 1)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    a, b = eng.generate([p, p], params)  # same seed, same batch or not: the same tokens
    (c,) = eng.generate([p], params)
    (d,) = eng.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=12, ignore_eos=True))
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids
    assert d.output_token_ids != a.output_token_ids
    (g1,) = eng.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    (g2,) = eng.generate([p], SamplingParams(max_tokens=8, top_k=1, temperature=2.0, seed=3, ignore_eos=True))
    assert g1.output_token_ids == g2.output_token_ids


def test_engine_stop_string_and_eos(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine()
    p = prompt(12, 2)
    texts: dict[str, str] = {}

    def run(rid: str, params: SamplingParams) -> Request:
        req = Request(request_id=rid, prompt_token_ids=p, sampling=params)
        done: list[TokenOutput] = []
        req.sink = done.append
        eng.add_request(req)
        end = time.monotonic() + 60
        while not (done and done[-1].finish_reason) and time.monotonic() < end:
            time.sleep(0.005)
        assert done and done[-1].finish_reason
        texts[rid] = "".join(o.text for o in done)
        return req

    full = run("full", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    text = texts["full"]
    assert len(text) >= 6, f"need some greedy text to cut: {text!r}"
    stop = text[3:5]
    cut = run("cut", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert texts["cut"] == text[: text.find(stop)]
    assert stop not in texts["cut"]
    assert cut.output_token_ids == full.output_token_ids[: len(cut.output_token_ids)]

    # EOS: force the 4th sampled token of request "eos" to be an EOS id.
    inner = outputs_module.sample

    def forced(logits: torch.Tensor, reqs: list[Request], gens: dict[str, torch.Generator],
               eos: list[int]) -> list[Sampled]:
        out = inner(logits, reqs, gens, eos)
        return [Sampled(EOS) if r.request_id.startswith("eos") and len(r.output_token_ids) == 3 else t
                for r, t in zip(reqs, out, strict=True)]

    monkeypatch.setattr(decode_module, "sample", forced)  # decode steps sample there
    eos = run("eos", SamplingParams(max_tokens=40, temperature=0.0))
    assert eos.finish_reason == "stop" and len(eos.output_token_ids) == 4 and eos.output_token_ids[-1] == EOS
    kept = run("eos-ignored", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert kept.finish_reason == "length" and len(kept.output_token_ids) == 10
    assert kept.output_token_ids[3] == EOS
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_engine_min_tokens_and_stop_token_ids(make_engine: Callable[..., Engine]) -> None:
    """vLLM's extensions end to end: EOS pushed to the top by logit_bias is held back until
    min_tokens; a stop token id ends the answer with its text kept."""
    eng = make_engine()
    p = prompt(20, 5)
    held = eng.generate([p], SamplingParams(max_tokens=40, temperature=0.0, min_tokens=5, logit_bias={EOS: 100.0}))[0]
    assert held.finish_reason == "stop" and len(held.output_token_ids) == 6 and held.output_token_ids[-1] == EOS
    assert EOS not in held.output_token_ids[:5]
    a = ord("A")
    stopped = eng.generate([p], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[a],
                                               logit_bias={a: 100.0}))[0]
    assert stopped.finish_reason == "stop" and stopped.output_token_ids == [a]
