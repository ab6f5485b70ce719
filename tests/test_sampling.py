"""Logit bias, penalties and logprobs (engine/core/sampling.py), their request fields (engine/protocol/openai.py)
and their hand-off between disaggregated workers. tests/test_reference.py checks repetition_penalty
and logprobs against transformers' generate; tests/test_gateway.py the HTTP shapes through a server."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from engine.core import handoff
from engine.core.request import Logprob, Request, Sampled, SamplingParams
from engine.core.sampling import draw, penalized, sample
from engine.protocol.openai import ChatCompletionRequest, CompletionRequest, Unsupported
from engine.serving.choices import LogprobFormatter

VOCAB = 12


def req(prompt: list[int], output: list[int], **sampling: object) -> Request:
    r = Request(request_id="r", prompt_token_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]
    r.output_token_ids = list(output)
    return r


def test_presence_and_frequency_penalties_are_openais_formula() -> None:
    """mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c counting output tokens only."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    r = req([5, 5, 6], [1, 3, 3, 3, 7], presence_penalty=0.5, frequency_penalty=-0.25)
    want = logits.clone()
    for j in range(VOCAB):
        c = r.output_token_ids.count(j)
        want[j] -= c * -0.25 + (c > 0) * 0.5
    torch.testing.assert_close(penalized(logits, r), want)
    assert torch.equal(logits, torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)))  # not in place


def test_logit_bias_then_repetition_penalty() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    r = req([0, 1], [2], repetition_penalty=2.0, logit_bias={4: 10.0, 5: -100.0})
    # seen (prompt or output): 0, 1, 2 -> positive halved, negative doubled; 4 and 5 biased first
    assert penalized(logits, r).tolist() == [1.0, -4.0, 0.5, -1.0, 10.5, -97.0]


def test_greedy_follows_the_processed_logits_and_logprobs_the_raw_ones() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    banned = req([0], [], temperature=0, logit_bias={1: -100.0}, logprobs=2)
    (out,) = sample(logits, [banned], {})
    assert isinstance(out, Sampled) and out.token == 3
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprob is not None and out.logprob.token_id == 3
    assert out.logprob.logprob == pytest.approx(float(raw[3]))
    assert [t for t, _ in out.logprob.top] == [1, 3]  # the model's likeliest, bias or not
    assert [lp for _, lp in out.logprob.top] == pytest.approx([float(raw[1]), float(raw[3])])
    forced = req([0], [], temperature=1.0, seed=0, logit_bias={0: 100.0})
    assert all(sample(logits, [forced], {})[0].token == 0 for _ in range(20))  # type: ignore[union-attr]
    plain = req([0], [], temperature=0)
    assert sample(logits, [plain], {}) == [Sampled(1)]  # no logprobs unless asked


@pytest.mark.parametrize(("fields", "message"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty must be in"),
    ({"logit_bias": {3: 101.0}}, "logit_bias values"),
    ({"logprobs": 21}, "top logprobs must be in"),
    ({"min_p": 1.5}, "min_p must be in"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens must be in"),
])
def test_out_of_range_values_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields).validate()  # type: ignore[arg-type]


def test_request_fields() -> None:
    chat = ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=3, presence_penalty=0.1,
                                 logit_bias={"7": -5.0})
    p = chat.sampling(16)
    assert (p.logprobs, p.presence_penalty, p.logit_bias) == (3, 0.1, {7: -5.0})
    assert ChatCompletionRequest(messages=[], logprobs=True).sampling(16).logprobs == 0
    assert ChatCompletionRequest(messages=[]).sampling(16).logprobs is None
    assert CompletionRequest(prompt="x", logprobs=0).sampling(16).logprobs == 0
    with pytest.raises(ValueError, match="top_logprobs needs logprobs: true"):
        ChatCompletionRequest(messages=[], top_logprobs=2).sampling(16)
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        CompletionRequest(prompt="x", logit_bias={"hello": 1.0}).sampling(16)
    # Known fields we do not implement are refused, naming the field; their neutral values pass.
    for body, field in [(ChatCompletionRequest(messages=[], tools=[{"type": "function"}]), "tools"),
                        (ChatCompletionRequest(messages=[], response_format={"type": "structural_tag"}),
                         "response_format"),
                        (CompletionRequest(prompt="x", best_of=3), "best_of"),
                        (CompletionRequest(prompt="x", suffix="end"), "suffix"),
                        (ChatCompletionRequest(messages=[], functions=[{"name": "f"}]), "tools"),
                        (CompletionRequest(prompt="x", use_beam_search=True), "use_beam_search")]:
        with pytest.raises(Unsupported) as err:
            body.sampling(16)
        assert err.value.field == field
    ChatCompletionRequest(messages=[], tools=[{"type": "function"}], tool_choice="none",
                          response_format={"type": "text"}).sampling(16)
    CompletionRequest(prompt="x", best_of=1, echo=False).sampling(16)
    # OpenAI's clients send null for "not set"
    nulls = msgspec.json.decode(b'{"messages": [], "presence_penalty": null, "frequency_penalty": null, '
                                b'"repetition_penalty": null, "logprobs": null, "top_logprobs": null, '
                                b'"logit_bias": null, "tools": null, "tool_choice": null}', type=ChatCompletionRequest)
    assert nulls.sampling(16) == SamplingParams()
    assert msgspec.json.decode(b'{"prompt": "x", "echo": null, "logprobs": null}',
                               type=CompletionRequest).sampling(16) == SamplingParams()
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        CompletionRequest(prompt="x", logit_bias={"1_0": 1.0}).sampling(16)


def test_logprob_shapes_are_openais() -> None:
    token_bytes = {5: b"He", 6: b"llo", 7: b"\xe2\x80", 8: b"\x99"}.__getitem__  # 7 + 8: one character
    entries = [Logprob(5, -0.5, [(5, -0.5), (6, -1.5)]), Logprob(7, -0.25, [(6, -0.125), (8, float("-inf"))])]
    chat = LogprobFormatter(token_bytes, chat=True).format(entries)
    assert chat == {"content": [
        {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "llo", "logprob": -1.5, "bytes": [108, 108, 111]}]},
        {"token": "\\xe2\\x80", "logprob": -0.25, "bytes": [226, 128], "top_logprobs": [
            {"token": "llo", "logprob": -0.125, "bytes": [108, 108, 111]},
            {"token": "\\x99", "logprob": -9999.0, "bytes": [153]}]}]}  # -inf floored, as vLLM's
    streamed = LogprobFormatter(token_bytes, chat=False)  # one chunk per token: offsets carry on
    assert [streamed.format([e]) for e in entries] == [
        {"tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5, "llo": -1.5}], "text_offset": [0]},
        # the sampled token is listed even when not among the likeliest (logprobs + 1 entries)
        {"tokens": ["\\xe2\\x80"], "token_logprobs": [-0.25],
         "top_logprobs": [{"llo": -0.125, "\\x99": -9999.0, "\\xe2\\x80": -0.25}], "text_offset": [2]}]
    assert LogprobFormatter(token_bytes, chat=False).format([Logprob(6, -2.0)])["top_logprobs"] == [{"llo": -2.0}]


def test_token_bytes_are_exact_for_byte_level_and_sentencepiece_vocabularies(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.core.tokenizer import HFTokenizer

    text = "Hé said “hi” 🙂"
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(set(
        pre_tokenizers.ByteLevel.alphabet())))}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    spm = Tokenizer(models.BPE(vocab={"\u2581said": 0, "\u2581": 1, "H": 2, "i": 3, **{f"<0x{b:02X}>": 4 + b
                                                                                     for b in range(256)}},
                               merges=[], byte_fallback=True))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    for name, tok in (("byte-level", byte_level), ("sentencepiece", spm)):
        (tmp_path / name).mkdir()
        tok.save(str(tmp_path / name / "tokenizer.json"))
        hf = HFTokenizer(tmp_path / name, [])
        ids = hf.encode(text)
        assert b"".join(hf.token_bytes(i) for i in ids).decode().lstrip() == text, name
        assert hf.token_bytes(ids[-1]) != b"" and len(ids) > 4


@pytest.mark.parametrize("first", [Sampled(9), Sampled(9, Logprob(9, -0.75, [(9, -0.75), (4, -1.0)])),
                                   Sampled(9, Logprob(9, -0.75))])
def test_the_first_tokens_logprobs_travel_with_the_kv(first: Sampled) -> None:
    kv = {"k.0": torch.ones(3, 2, 4), "v.0": torch.zeros(3, 2, 4)}
    got_kv, got = handoff.unpack(handoff.pack(kv, first))
    assert got == first and set(got_kv) == {"k.0", "v.0"}


def test_messages_as_chat_templates_read_them() -> None:
    from engine.protocol.openai import ChatMessage

    assert ChatMessage("developer", "be brief").for_template() == {"role": "system", "content": "be brief"}
    parts = ChatMessage("user", [{"type": "text", "text": "a"}, {"type": "text", "text": None},
                                 {"type": "text", "text": "b"}])
    assert parts.for_template() == {"role": "user", "content": "a\n\nb"}  # vLLM joins text parts by newlines
    # Llama 3.1's template treats any `tool_calls` key as a call: empty ones are left out
    assert ChatMessage("assistant", None, tool_calls=[]).for_template() == {"role": "assistant", "content": ""}
    tool = ChatMessage("tool", "42", tool_call_id="call-1", name="calc").for_template()
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "call-1", "name": "calc"}
    with pytest.raises(ValueError, match="only text content parts"):
        ChatMessage("user", [{"type": "input_audio", "input_audio": {}}]).for_template()


def test_vllm_extensions_reach_the_sampler() -> None:
    p = CompletionRequest(prompt="x", min_p=0.1, min_tokens=3, stop_token_ids=[7, 9],
                          include_stop_str_in_output=True, use_beam_search=False).sampling(16)
    assert (p.min_p, p.min_tokens, p.stop_token_ids, p.include_stop_str_in_output) == (0.1, 3, [7, 9], True)
    nulls = msgspec.json.decode(b'{"prompt": "x", "min_p": null, "min_tokens": null, "stop_token_ids": null, '
                                b'"include_stop_str_in_output": null, "use_beam_search": null}', type=CompletionRequest)
    assert nulls.sampling(16) == SamplingParams()


def test_min_p_keeps_tokens_within_a_share_of_the_likeliest() -> None:
    """vLLM's min-p: after temperature, tokens below min_p x the likeliest's probability are out."""
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = probs.log().unsqueeze(0)
    r = req([0], [], temperature=1.0, min_p=0.2, seed=0)  # keeps p >= 0.1: tokens 0, 1, 2
    gens: dict[str, torch.Generator] = {}  # one seeded stream of draws
    drawn = {sample(logits, [r], gens)[0].token for _ in range(300)}  # type: ignore[union-attr]
    assert drawn == {0, 1, 2}
    hot = req([0], [], temperature=2.0, min_p=0.2, seed=0)  # flatter after temperature: 3 is back in
    gens.clear()
    assert 3 in {sample(logits, [hot], gens)[0].token for _ in range(400)}  # type: ignore[union-attr]


def test_min_tokens_holds_back_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 9.0, 1.0]])  # the likeliest two end the answer
    early = req([0], [3, 3], temperature=0, min_tokens=3, stop_token_ids=[1])
    assert sample(logits, [early], {}, eos=[2]) == [Sampled(3)]
    done = req([0], [3, 3, 3], temperature=0, min_tokens=3, stop_token_ids=[1])
    assert sample(logits, [done], {}, eos=[2]) == [Sampled(2)]
    # (found by fuzzing) a temperature beyond float32's range over the masked logits: no NaN
    hot = req([0], [], temperature=1.7976931348623155e308, min_tokens=3, stop_token_ids=[1], seed=0)
    assert sample(logits, [hot], {}, eos=[2])[0].token in (0, 3)  # type: ignore[union-attr]
    ignoring = req([0], [], temperature=0, min_tokens=3, ignore_eos=True)
    assert sample(logits, [ignoring], {}, eos=[2]) == [Sampled(2)]  # ignore_eos: EOS is no stop to hold


class _Tok:
    eos_token_ids = (0,)

    def incremental_decoder(self) -> _Dec:
        return _Dec()


class _Dec:
    def push(self, token: int) -> str:
        return chr(ord("a") + token - 1)


def stream(tokens: list[int], **sampling: object) -> tuple[str, str | None]:
    from engine.core.decode import OutputStream

    r = req([1], [], **{"max_tokens": 50, **sampling})
    out = OutputStream(r, _Tok())  # type: ignore[arg-type]
    text, finish = "", None
    for t in tokens:
        o = out.push(Sampled(t))
        text, finish = text + o.text, o.finish_reason
        if finish:
            break
    return text, finish


def test_stop_token_ids_stop_strings_and_min_tokens_in_the_stream() -> None:
    assert stream([1, 2, 3, 4, 5], stop_token_ids=[3]) == ("ab", "stop")  # as vLLM: the stop id's text goes
    assert stream([1, 2, 3, 4, 5], stop_token_ids=[3], include_stop_str_in_output=True) == ("abc", "stop")
    assert stream([1, 2, 3, 4, 5], stop=["cd"]) == ("ab", "stop")
    assert stream([1, 2, 3, 4, 5], stop=["cd"], include_stop_str_in_output=True) == ("abcd", "stop")
    # before min_tokens, a stop string does not stop (as vLLM); one that completes later does
    assert stream([1, 2, 1, 2, 5], stop=["ab"]) == ("", "stop")
    assert stream([1, 2, 1, 2, 5], stop=["ab"], min_tokens=3) == ("ab", "stop")  # the first "ab" passes


def test_a_stop_string_must_end_after_the_first_min_tokens_tokens() -> None:
    """(Found by review.) "b" completes at token 2, under min_tokens, held back as a prefix of "abcd":
    it must not stop the answer once min_tokens is reached, nor cut the text at an EOS."""
    assert stream([1, 2, 3, 24, 24, 24], stop=["b", "abcd"], min_tokens=4, max_tokens=6) == ("abcxxx", "length")
    assert stream([1, 2, 3, 0], stop=["b", "abcd"], min_tokens=3) == ("abc", "stop")
    # one that ends after them counts, even begun inside them (vLLM's search reaches back len(stop) - 1)
    assert stream([1, 2, 3, 4, 2], stop=["b", "abcd"], min_tokens=3) == ("", "stop")


def test_draw_follows_the_weights_and_never_picks_a_zero() -> None:
    """The CPU sampler's inverse-transform draw: frequencies follow the weights (any total), ids of weight
    zero (masked by top-k, top-p, min-p) never come, and a seeded generator repeats its draws."""
    weights = torch.tensor([0.0, 5.0, 0.0, 3.0, 2.0, 0.0])
    gen = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(20000)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts.double() / 20000, weights.double() / 10, atol=0.015, rtol=0)
    seeded = [draw(weights, torch.Generator().manual_seed(3)) for _ in range(5)]
    assert len(set(seeded)) == 1
    last_only = torch.zeros(49152)
    last_only[-1] = 1e-30  # a vocabulary-sized row whose one allowed id is the last
    assert draw(last_only, gen) == 49151
