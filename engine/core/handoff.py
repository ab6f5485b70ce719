"""Prefill/decode disaggregation, the engine's side: a prefilled request's prompt KV and first token
as one safetensors blob (`k.{layer}`, `v.{layer}`: [prompt tokens, kv heads, head dim], plus
`first_token`, and its log-probabilities `first_logprob`/`first_top_ids` when the request asked for
them), and the check a decode worker's engine makes before it takes such KV in (Engine.add_prefilled).
How the blob travels from the prefill worker to the decode worker is the serving layer's:
engine/serving/kv_transport.py."""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from engine.core.config import ModelConfig
from engine.core.request import Logprob, Request, Sampled


def to_tensors(kv: dict[str, torch.Tensor], first: Sampled) -> dict[str, torch.Tensor]:
    tensors = {name: t.contiguous().cpu() for name, t in kv.items()}
    tensors["first_token"] = torch.tensor([first.token], dtype=torch.int64)
    if first.logprob is not None:  # the request asked for logprobs: the first token's travel with it
        lp = first.logprob
        tensors["first_logprob"] = torch.tensor([lp.logprob, *(v for _, v in lp.top)], dtype=torch.float64)
        tensors["first_top_ids"] = torch.tensor([t for t, _ in lp.top], dtype=torch.int64)
    return tensors


def pack(kv: dict[str, torch.Tensor], first: Sampled) -> bytes:
    return save(to_tensors(kv, first))


def from_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Sampled]:
    first = tensors.pop("first_token", None)
    if first is None or first.numel() != 1:
        raise ValueError("handed-off KV has no first_token")
    token = int(first.item())
    values, top_ids = tensors.pop("first_logprob", None), tensors.pop("first_top_ids", None)
    if values is None:
        return tensors, Sampled(token)
    if top_ids is None or values.numel() != top_ids.numel() + 1:
        raise ValueError("handed-off first_logprob and first_top_ids do not match")
    top = list(zip(top_ids.tolist(), values[1:].tolist(), strict=True))
    return tensors, Sampled(token, Logprob(token, float(values[0]), top))


def unpack(blob: bytes) -> tuple[dict[str, torch.Tensor], Sampled]:
    return from_tensors(load(blob))


def check(cfg: ModelConfig, req: Request, kv: dict[str, torch.Tensor], first: Sampled) -> None:
    """Raises ValueError for handed-off KV or a first token that does not fit this model and prompt."""
    lp = first.logprob
    if not 0 <= first.token < cfg.vocab_size or (lp is not None and (
            lp.token_id != first.token or not all(0 <= t < cfg.vocab_size for t, _ in lp.top))):
        raise ValueError(f"handed-off first token {first.token} (or its logprobs) is not in [0, {cfg.vocab_size})")
    want = (req.num_prompt_tokens, cfg.num_key_value_heads, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        for kind in "kv":
            t = kv.get(f"{kind}.{layer}")
            if t is None or tuple(t.shape) != want:
                raise ValueError(f"handed-off KV {kind}.{layer}: expected shape {want}, got "
                                 f"{None if t is None else tuple(t.shape)}")
