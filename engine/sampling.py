"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request], generators: dict[str, torch.Generator]
           ) -> list[int | Exception]:
    """One token per row of logits [batch, vocab], or the exception that row raised: a request whose
    parameters trip a bug fails alone, not every request sampled with it."""
    out: list[int | Exception] = []
    for row, req in zip(logits, requests, strict=True):
        try:
            out.append(sample_row(row, req, generators))
        except Exception as exc:  # the caller fails this request with it
            out.append(exc)
    return out


def sample_row(row: torch.Tensor, req: Request, generators: dict[str, torch.Generator]) -> int:
    p = req.sampling
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and the likeliest token always: a top_p below float32's range rounds to 0
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    gen = generators.get(req.request_id)
    if gen is None and p.seed is not None:
        gen = generators[req.request_id] = torch.Generator(device=row.device).manual_seed(p.seed)
    return int(torch.multinomial(probs, 1, generator=gen))
