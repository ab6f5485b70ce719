"""Token sampling: structured output's mask, logit bias and penalties, min_tokens, greedy,
temperature, min-p, top-k, top-p, per-request seeds, and the sampled token's log-probability."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from engine.core.request import Logprob, Request, Sampled


class TokenConstraint(Protocol):
    """What an answer must follow token by token (`Request.constraint`): the serving layer's structured
    output, which a reasoning model's reasoning may come before (engine/serving/structured_output.py's
    GuidedAnswer). The engine thread calls it: `mask` before each token is sampled, `accept` after."""

    def mask(self, row: torch.Tensor, hold: list[int] | None) -> torch.Tensor:
        """The logits with each token that may not come next at -inf; `hold`: tokens to leave out
        too (the end of sequence under ignore_eos), unless nothing else is allowed."""
        ...

    def accept(self, token: int, text: str) -> bool:
        """Follow the sampled token (`text`: what it decoded to, "" for one that ends the answer); True
        when the constraint is complete (only the end may follow). ValueError when it cannot."""
        ...


def sample(logits: torch.Tensor, requests: list[Request], generators: dict[str, torch.Generator],
           eos: Sequence[int] = ()) -> list[Sampled | Exception]:
    """One token per row of logits [batch, vocab], or the exception that row raised: a request whose
    parameters trip a bug fails alone, not every request sampled with it. `eos`: the model's
    end-of-sequence ids (which min_tokens holds back)."""
    out: list[Sampled | Exception] = []
    for row, req in zip(logits, requests, strict=True):
        try:
            if req.constraint is not None:  # first, as vLLM: the constraint decides which tokens exist
                row = req.constraint.mask(row, list(eos) if req.sampling.ignore_eos else None)
            early = len(req.output_token_ids) < req.sampling.min_tokens
            token = sample_row(penalized(row, req, eos if early else None) if req.sampling.penalized or early
                               else row, req, generators)
            k = req.sampling.logprobs
            out.append(Sampled(token, None if k is None else logprob(row, token, k)))
        except Exception as exc:  # the caller fails this request with it
            out.append(exc)
    return out


def penalized(row: torch.Tensor, req: Request, eos: Sequence[int] | None = None) -> torch.Tensor:
    """The logits after logit_bias, then the penalties, in vLLM's order and with its semantics:
    repetition_penalty divides positive logits and multiplies negative ones of every token seen in
    the prompt or the output (HF's definition); frequency_penalty subtracts once per occurrence in
    the output and presence_penalty once for any (OpenAI's). With `eos` (an answer short of its
    min_tokens), the tokens that would end it cannot be sampled."""
    p, dev = req.sampling, row.device
    row = row.float().clone()
    if p.logit_bias:
        row[torch.tensor(list(p.logit_bias), device=dev)] += torch.tensor(list(p.logit_bias.values()), device=dev)
    out = torch.tensor(req.output_token_ids, dtype=torch.long, device=dev)
    if p.repetition_penalty != 1.0:
        if req.prompt_token_mask is None:  # once per request, not per token: prompts run to 10K+ tokens
            req.prompt_token_mask = torch.zeros(row.numel(), dtype=torch.bool, device=dev)
            req.prompt_token_mask[torch.tensor(req.prompt_token_ids, dtype=torch.long, device=dev)] = True
        seen = req.prompt_token_mask.clone()
        seen[out] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, scaled, row)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(out, minlength=row.numel()).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if eos is not None and (ends := [*([] if p.ignore_eos else eos), *p.stop_token_ids]):
        held = torch.tensor(ends, dtype=torch.long, device=dev)
        kept = row[held]
        row[held] = float("-inf")
        if not bool(torch.isfinite(row).any()):  # a structured output only the end can complete: it ends
            row[held] = kept
    return row


def sample_row(row: torch.Tensor, req: Request, generators: dict[str, torch.Generator]) -> int:
    p = req.sampling
    if p.greedy:
        return int(row.argmax())
    # float32 turns a temperature past ~3.4e38 into inf, and a masked -inf logit over it into NaN
    row = row / min(p.temperature, 1e30)
    if p.min_p:  # vLLM's order: after temperature, before top-k and top-p
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    gen = generators.get(req.request_id)
    if gen is None and p.seed is not None:
        gen = generators[req.request_id] = torch.Generator(device=row.device).manual_seed(p.seed)
    if p.top_p < 1.0:
        ids, kept = nucleus(probs, p.top_p)
        if probs.device.type != "cuda":
            return draw_among(ids, kept, gen)
        probs = torch.zeros_like(probs).scatter_(0, ids, kept)
    return draw(probs, gen)


# The first try's width in `nucleus`: a chat model's nucleus at top_p 0.9-0.95 mostly fits (SmolLM2's
# answers: a few to some tens of ids).
NUCLEUS_FIRST_K = 64


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of likeliest ids whose probabilities reach top_p, and those probabilities (the
    likeliest id always: a top_p below float32's range rounds to 0), ties at the cut broken by id (the
    lowest kept), as a stable sort of the vocabulary orders them. Found among the top k likeliest, k
    grown until the set ends inside them, not by sorting the vocabulary: on one EPYC core, sampling a
    token of SmolLM2 (49,152 ids) with top_p took 3.8 ms with the sort, 0.21 ms so. The running sums
    over the top k are the first k of the sorted running sums."""
    n, k = probs.numel(), min(NUCLEUS_FIRST_K, probs.numel())
    while True:
        top, ids = probs.sort(descending=True, stable=True) if 4 * k >= n else probs.topk(k)
        drop = top.cumsum(0) - top >= top_p  # the probability before each id already reaches top_p
        drop[0] = False
        if len(top) == n or bool(drop[-1]):  # beyond the last id tried every id is dropped too
            break
        # a flat distribution's nucleus is much of the vocabulary: straight to the sort, not k by k
        k = n if float(top.sum()) < top_p / 2 else 8 * k
    keep = ~drop
    last = top[keep][-1]  # the least kept probability
    tie = top == last
    kept_tied = int((tie & keep).sum())
    # The cut falls inside a run of equal probabilities (a bf16 model's are often equal), or that run
    # may go on past the top k: which of its ids the nucleus holds is the lowest ones, whatever order
    # topk left them in.
    if kept_tied < int(tie.sum()) or (len(top) < n and bool(top[-1] == last)):
        lowest = (probs == last).nonzero().flatten()[:kept_tied]
        above = keep & ~tie
        return torch.cat((ids[above], lowest)), torch.cat((top[above], probs[lowest]))
    return ids[keep], top[keep]


def draw(probs: torch.Tensor, gen: torch.Generator | None = None) -> int:
    """One id drawn from `probs` (any non-negative weights): inverse transform sampling, a uniform draw
    located in their running sum. Not torch.multinomial, which on a CPU took 1.0 ms for SmolLM2's 49,152
    ids on one EPYC core (this: 0.07 ms), a millisecond on every sampled token of every answer. On CUDA
    multinomial is fast, so it stays."""
    if probs.device.type == "cuda":
        return int(torch.multinomial(probs, 1, generator=gen))
    cdf = probs.double().cumsum(0)  # float64: 49,152 float32 partial sums drift by up to ~1e-4 relative
    u = torch.rand(1, dtype=torch.float64, generator=gen) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # the first id whose running sum passes u
    return i if i < len(cdf) else int(probs.nonzero()[-1])  # (u rounded up to the total)


def draw_among(ids: torch.Tensor, weights: torch.Tensor, gen: torch.Generator | None = None) -> int:
    """`draw` over a vocabulary whose other ids weigh 0, from the given ones alone: the same id as `draw`
    on the whole vocabulary for the same generator state (the running sum in id order over the ids
    given is the whole one's, where it rises)."""
    ids, order = ids.sort()
    weights = weights[order]
    cdf = weights.double().cumsum(0)
    u = torch.rand(1, dtype=torch.float64, generator=gen) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    return int(ids[i]) if i < len(cdf) else int(ids[weights.nonzero()[-1]])


def logprob(row: torch.Tensor, token: int, top: int) -> Logprob:
    """token's log-probability under the distribution of the raw logits row, and the top likeliest."""
    lp = torch.log_softmax(row.float(), dim=-1)
    alternatives: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Logprob(token, float(lp[token]), alternatives)


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor | None, targets: list[int],
                    top: int, chunk: int = 256) -> list[Logprob]:
    """Each target token's log-probability under the logits of the hidden state before it, with the
    `top` likeliest, a chunk of rows at a time (a long prompt's logits would not fit at once)."""
    out: list[Logprob] = []
    for a in range(0, len(targets), chunk):
        assert hidden is not None
        lp = torch.log_softmax(logits_of(hidden[a:a + chunk]).float(), dim=-1)
        ids = targets[a:a + chunk]
        picked = lp.gather(1, torch.tensor(ids, device=lp.device)[:, None])
        chosen, ranks = picked[:, 0].tolist(), ((lp > picked).sum(dim=1) + 1).tolist()
        if top:
            values, tops = torch.topk(lp, min(top, lp.shape[1]))
            alternatives = [list(zip(t, v, strict=True)) for t, v in zip(tops.tolist(), values.tolist(), strict=True)]
        else:
            alternatives = [[] for _ in ids]
        out += [Logprob(t, c, alt, r) for t, c, alt, r in zip(ids, chosen, alternatives, ranks, strict=True)]
    return out
