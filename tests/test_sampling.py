"""Logit bias, penalties and logprobs (engine/sampling.py), their request fields (engine/openai_api.py)
and their hand-off between disaggregated workers. tests/test_reference.py checks repetition_penalty
and logprobs against transformers' generate; tests/test_gateway.py the HTTP shapes through a server."""

from __future__ import annotations

import pytest
import torch

from engine import handoff
from engine.openai_api import ChatCompletionRequest, CompletionRequest, LogprobFormatter, Unsupported
from engine.request import Logprob, Request, Sampled, SamplingParams
from engine.sampling import penalized, sample

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
                        (ChatCompletionRequest(messages=[], response_format={"type": "json_object"}),
                         "response_format"),
                        (CompletionRequest(prompt="x", echo=True), "echo"),
                        (CompletionRequest(prompt="x", best_of=3), "best_of"),
                        (CompletionRequest(prompt="x", suffix="end"), "suffix"),
                        (CompletionRequest(prompt="x", n=2), "n")]:
        with pytest.raises(Unsupported) as err:
            body.sampling(16)
        assert err.value.field == field
    ChatCompletionRequest(messages=[], tools=[{"type": "function"}], tool_choice="none",
                          response_format={"type": "text"}).sampling(16)
    CompletionRequest(prompt="x", best_of=1, echo=False).sampling(16)


def test_logprob_shapes_are_openais() -> None:
    text = {5: "He", 6: "llo", 7: "\ufffd"}.__getitem__
    entries = [Logprob(5, -0.5, [(5, -0.5), (6, -1.5)]), Logprob(6, -0.25, [(6, -0.25), (7, -3.0)])]
    chat = LogprobFormatter(text, chat=True, top=2).format(entries)
    assert chat == {"content": [
        {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "llo", "logprob": -1.5, "bytes": [108, 108, 111]}]},
        {"token": "llo", "logprob": -0.25, "bytes": [108, 108, 111], "top_logprobs": [
            {"token": "llo", "logprob": -0.25, "bytes": [108, 108, 111]},
            {"token": "\ufffd", "logprob": -3.0, "bytes": [239, 191, 189]}]}]}
    streamed = LogprobFormatter(text, chat=False, top=2)  # one chunk per token: offsets carry on
    assert [streamed.format([e]) for e in entries] == [
        {"tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5, "llo": -1.5}], "text_offset": [0]},
        {"tokens": ["llo"], "token_logprobs": [-0.25], "top_logprobs": [{"llo": -0.25, "\ufffd": -3.0}],
         "text_offset": [2]}]
    assert LogprobFormatter(text, chat=False, top=0).format(entries[:1])["top_logprobs"] is None


@pytest.mark.parametrize("first", [Sampled(9), Sampled(9, Logprob(9, -0.75, [(9, -0.75), (4, -1.0)])),
                                   Sampled(9, Logprob(9, -0.75))])
def test_the_first_tokens_logprobs_travel_with_the_kv(first: Sampled) -> None:
    kv = {"k.0": torch.ones(3, 2, 4), "v.0": torch.zeros(3, 2, 4)}
    got_kv, got = handoff.unpack(handoff.pack(kv, first))
    assert got == first and set(got_kv) == {"k.0", "v.0"}
