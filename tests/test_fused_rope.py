"""The fused RoPE path (engine/model/rope.py `use_fused`, engine/model/kernels.py `fuse_rope`) off a GPU.

FlashInfer's kernel needs CUDA (tests/test_flashinfer.py runs it). Here a torch function with its
documented contract — `apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
is_neox)`: rows of a float32 table indexed by position, cosines in the first half and sines in the
second, rotation in fp32, new [nnz, heads * head_size] tensors — checks everything of ours around it:
the table we build (scaled, every position of the context), the rows the forward passes (positions,
sliced with the steps' rows, copied into graph buckets), and the probe that refuses a kernel that
disagrees.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import RerunCapture
from test_graphs import batch, finished
from test_preemption import BUDGET, CFG, FP32, fresh_kv, kv_of, make_weights

from engine.attention.sdpa import SDPABackend
from engine.core.kv_cache import KVCache
from engine.model.graphs import StepGraphs
from engine.model.kernels import _probe_rope, fuse_rope
from engine.model.llama import LlamaModel
from engine.model.rope import Rotary


def cos_sin_cache_rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                       cos_sin_cache: torch.Tensor, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    assert cos_sin_cache.dtype == torch.float32 and is_neox
    table = cos_sin_cache[positions].unsqueeze(1)
    cos, sin = table.chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(x.shape[0], -1, head_size).float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype).flatten(1)

    return rotate(query), rotate(key)


def swapped_halves(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                   cos_sin_cache: torch.Tensor, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel that reads the table as sin|cos: what the probe must catch."""
    return cos_sin_cache_rope(positions, query, key, head_size, cos_sin_cache.roll(cos_sin_cache.shape[1] // 2, 1))


SCALINGS = [{}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 1024},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "llama3", "yarn"])
def test_the_fused_table_rotates_as_torch_does(scaling: dict) -> None:
    """Every position of the context, with each scaling's frequencies and (yarn) attention factor."""
    plain = Rotary(64, 500000.0, scaling, 8192, torch.float32, torch.device("cpu"))
    fused = Rotary(64, 500000.0, scaling, 8192, torch.float32, torch.device("cpu"))
    fused.use_fused(cos_sin_cache_rope)
    _probe_rope(fused, heads=8, kv_heads=2)
    qkv = torch.randn(300, 12 * 64)
    q, k, _ = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)  # column slices, as the model passes them
    pos = torch.cat([torch.arange(150), torch.arange(8192 - 150, 8192)])
    plain.reserve(8192)
    fused.reserve(8192)
    for got, want in zip(fused.apply(q, k, fused.rows(pos)), plain.apply(q, k, plain.rows(pos)), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="past the model's context of 8192"):
        fused.reserve(8193)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_a_spans_rows_are_the_gathered_rows_without_a_copy(fused: bool) -> None:
    """One sequence's rotary rows are views of the table (an 8K prompt's were a 4 MB gather in its
    prefill's set-up, the stop-latency tail's first step), the same rotation as the gathered ones."""
    rotary = Rotary(64, 500000.0, {}, 8192, torch.float32, torch.device("cpu"))
    if fused:
        rotary.use_fused(cos_sin_cache_rope)
    rotary.reserve(8192)
    qkv = torch.randn(300, 12 * 64)
    q, k, _ = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
    span, gathered = rotary.span_rows(5000, 5300), rotary.rows(torch.arange(5000, 5300))
    for got, want in zip(rotary.apply(q, k, span), rotary.apply(q, k, gathered), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if not fused:
        assert span[0].untyped_storage().data_ptr() == rotary._cos.untyped_storage().data_ptr()


def test_a_kernel_that_disagrees_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    rotary = Rotary(64, 10000.0, {}, 4096, torch.bfloat16, torch.device("cpu"))
    rotary.use_fused(swapped_halves)
    with pytest.raises(RuntimeError, match="disagrees with torch"):
        _probe_rope(rotary, heads=4, kv_heads=4)
    # On a machine without FlashInfer `fuse_rope` falls back to torch's rotation, or fails if required.
    with caplog.at_level(logging.WARNING):
        fuse_rope(rotary, 4, 4, required=False)
    assert not rotary.fused and "RoPE kernel is not used" in caplog.text
    assert rotary._cos_sin.numel() == 0  # the table is freed with it
    with pytest.raises(ValueError, match="--row-kernels flashinfer: RoPE"):
        fuse_rope(rotary, 4, 4, required=True)


def model(fused: bool, graphs: bool = False) -> LlamaModel:
    m = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    if fused:
        m.rotary.use_fused(cos_sin_cache_rope)
    if graphs:
        m.graphs = StepGraphs(m, 256, RerunCapture())
    return m


@pytest.mark.parametrize(("lengths", "start"), [([100], 0), ([20, 1, 90], 0), ([60], 40)],
                         ids=["one", "ragged", "chunk"])
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["unsplit", "split"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_prefill_with_the_fused_rotation_gives_torchs_logits_and_kv(lengths: list[int], start: int,
                                                                    budget: float | None, graphs: bool) -> None:
    """Positions sliced with split steps' rows, offset by a cached prefix, padded into a bucket."""
    ref, fused = model(False), model(True, graphs)
    kv_r, kv_f = fresh_kv(), fresh_kv()
    b_r = batch(ref, kv_r, lengths, budget, start=start)
    b_f = batch(fused, kv_f, lengths, budget, start=start)
    torch.testing.assert_close(finished(b_f), finished(b_r), **FP32)
    for (fk, fv), (rk, rv) in zip(kv_of(kv_f, b_f), kv_of(kv_r, b_r), strict=True):
        torch.testing.assert_close(fk, rk, **FP32)
        torch.testing.assert_close(fv, rv, **FP32)


def test_decode_with_the_fused_rotation_gives_torchs_logits() -> None:
    logits = []
    for m in (model(False), model(True)):
        kv = KVCache(CFG, 16, 1024, torch.float32, "cpu")
        tables = [kv.allocate(40), kv.allocate(40)]
        for pos in range(3):  # three decode steps from position 0: each reads the KV the last wrote
            out = m.decode([5 + pos, 7 + pos], [pos, 30 + pos], tables, kv)
        logits.append(out)
    torch.testing.assert_close(logits[1], logits[0], **FP32)


def test_a_model_with_a_short_context_calibrates_with_the_fused_rotation() -> None:
    """Calibration times blocks of up to 4,096 rows: their positions wrap at a shorter context (the
    fused table holds exactly the context, where torch's grows)."""
    from dataclasses import replace

    from engine.model.calibration import calibrate

    short = replace(CFG, max_position_embeddings=1000)
    m = LlamaModel(short, make_weights(short), SDPABackend())
    m.rotary.use_fused(cos_sin_cache_rope)
    assert calibrate(m, block_rows=(128, 2048)).row_block_s
