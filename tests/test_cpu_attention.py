"""FlowPrefill's CPU attention kernel (engine/attention/cpu_flash.cpp) against the plain math in
float64, on random shapes: ragged lengths that are no multiple of the kernel's blocks, one query,
grouped-query heads of every ratio, each head size it is built for, causal and not, views of a fused
projection. The model-level checks (ragged batches, chunked prefill, split tiles, decode against
transformers) are tests/test_reference.py's, which run on this kernel wherever it is built."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from engine.attention import cpu, select_backend
from engine.attention.sdpa import SDPABackend

DTYPES = [torch.float32, torch.bfloat16]


def _skip_unless_built(dtype: torch.dtype, head_dim: int = 32) -> None:
    reason = cpu.unsupported(dtype, head_dim)
    if reason:
        pytest.skip(f"the CPU attention kernel {reason}")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, hq, d = q.shape
    group = hq // k.shape[1]
    qd = q.double().transpose(0, 1)
    kd, vd = (x.double().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    scores = qd @ kd.transpose(-1, -2) * d**-0.5
    if causal:  # bottom-right: query i of n sees keys up to len(k) - n + i
        scores = scores.masked_fill(~torch.ones(n, k.shape[0], dtype=torch.bool).tril(k.shape[0] - n), float("-inf"))
    return (torch.softmax(scores, -1) @ vd).transpose(0, 1), torch.logsumexp(scores, -1).transpose(0, 1)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _shapes(count: int, seed: int) -> list[tuple[int, int, int, int, int, bool]]:
    """(queries, keys, q heads, kv heads, head size, causal), random."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 7])
        causal = rng.random() < 0.6
        nq = rng.choice([1, 2, rng.randrange(3, 300)])
        nk = nq + rng.choice([0, 0, rng.randrange(1, 400)]) if causal else rng.randrange(1, 700)
        out.append((nq, nk, kv_heads * group, kv_heads, rng.choice(cpu.HEAD_DIMS), causal))
    return out


def _shape_id(s: tuple[int, int, int, int, int, bool]) -> str:
    return "q{}-k{}-h{}:{}-d{}{}".format(*s[:5], "-causal" * s[5])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", _shapes(24, seed=0), ids=_shape_id)
def test_kernel_matches_the_math_on_random_shapes(shape: tuple[int, int, int, int, int, bool],
                                                  dtype: torch.dtype) -> None:
    nq, nk, hq, hkv, d, causal = shape
    _skip_unless_built(dtype, d)
    gen = torch.Generator().manual_seed(nq * 1000 + nk)
    # q, k, v as the model makes them: column slices of one fused projection's rows (strided views)
    qkv = torch.randn(max(nq, nk), (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:nq, : hq * d].view(nq, hq, d)
    k = qkv[:nk, hq * d : (hq + hkv) * d].view(nk, hkv, d)
    v = qkv[:nk, (hq + hkv) * d :].reshape(nk, hkv, d)  # and one contiguous copy
    out, lse = cpu.attention(q, k, v, causal)
    want_out, want_lse = _reference(q, k, v, causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (nq, hq) and lse.dtype == torch.float32
    if dtype == torch.float32:
        assert _rel(out, want_out) < 2e-6 and _rel(lse, want_lse) < 2e-6
    else:  # bf16: no worse than torch's own bf16 kernel on the same inputs (plus a rounding's slack)
        torch_out, torch_lse = SDPABackend().tile(q, k, v, causal)
        assert _rel(out, want_out) <= 2 * _rel(torch_out, want_out) + 8e-3
        assert _rel(lse, want_lse) <= 2 * _rel(torch_lse, want_lse) + 2e-3


def _running(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """q's causal attention built over the key tiles `cuts` makes, the last one the diagonal."""
    tiles = cpu.RunningTiles(q)
    bounds = list(zip([0, *cuts], [*cuts, len(k)], strict=True))
    for i, (a, b) in enumerate(bounds):
        last = i == len(bounds) - 1
        out = tiles.add(k[a:b], v[a:b], causal=last, last=last)
        assert (out is None) != last
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_running_tiles_give_the_whole(dtype: torch.dtype) -> None:
    """A split query block's key tiles, its online softmax carried from tile to tile: on the kernel's
    128-key blocks the unsplit call's result bit for bit, elsewhere the same to rounding."""
    _skip_unless_built(dtype)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(100, 9, 64, generator=gen).to(dtype)
    k, v = (torch.randn(612, 3, 64, generator=gen).to(dtype) for _ in range(2))
    whole, _ = cpu.attention(q, k, v, True)
    assert torch.equal(_running(q, k, v, [128, 384]), whole)
    assert torch.equal(_running(q, k, v, []), whole)  # one tile: the plain kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(_running(q, k, v, [100, 233, 512]), whole.double()) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_running_tiles_keep_their_own_state(dtype: torch.dtype) -> None:
    """Two query blocks' tiles interleaved (as a preemption interleaves batches) keep apart; a tile
    over no keys leaves the state as it was."""
    _skip_unless_built(dtype)
    gen = torch.Generator().manual_seed(4)
    qs = [torch.randn(64, 8, 32, generator=gen).to(dtype) for _ in range(2)]
    k, v = (torch.randn(320, 2, 32, generator=gen).to(dtype) for _ in range(2))
    blocks = [cpu.RunningTiles(q) for q in qs]
    for a, b in ((0, 128), (128, 128), (128, 256)):
        for tiles in blocks:
            assert tiles.add(k[a:b], v[a:b], causal=False, last=False) is None
    for q, tiles in zip(qs, blocks, strict=True):
        assert torch.equal(tiles.add(k[256:], v[256:], causal=True, last=True), cpu.attention(q, k, v, True)[0])


def test_a_refused_first_tile_leaves_nothing_to_carry() -> None:
    """A first tile the kernel refuses (its keys' head size differs) must not leave the block's unfilled
    state to be carried: the next tile starts afresh."""
    _skip_unless_built(torch.float32)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(40, 4, 32, generator=gen)
    k, v = (torch.randn(200, 2, 32, generator=gen) for _ in range(2))
    tiles = cpu.RunningTiles(q)
    with pytest.raises(RuntimeError, match="head sizes differ"):
        tiles.add(k[:128, :, :16], v[:128, :, :16], causal=False, last=False)
    assert tiles.state is None
    assert tiles.add(k[:128], v[:128], causal=False, last=False) is None
    assert torch.equal(tiles.add(k[128:], v[128:], causal=True, last=True), cpu.attention(q, k, v, True)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "q_heads", "kv_heads", "block_size"),
                         [(64, 9, 3, 16), (32, 8, 2, 16), (128, 4, 4, 256), (16, 16, 2, 4), (64, 6, 3, 8)])
def test_decode_reads_the_paged_cache_in_place(dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int,
                                               block_size: int) -> None:
    """The decode kernel's answers (every sequence's one query against its blocks, scattered over the
    cache, lengths ending mid-block) are the math's on the same keys, gathered; and the backend's
    decode, tables made once for a step's layers, is the kernel's."""
    _skip_unless_built(dtype, head_dim)
    gen = torch.Generator().manual_seed(head_dim + q_heads)
    blocks = 120
    kc, vc = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    lengths = [1, block_size + 1, 5 * block_size - 3, 2 * block_size]
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lengths:
        k = -(-n // block_size)
        tables.append(order[used:used + k])
        used += k
    tables[1] += [order[-1]]  # a table may hold more blocks than its length fills
    q = torch.randn(len(lengths), q_heads, head_dim, generator=gen).to(dtype)
    width = max(map(len, tables))
    out = cpu._ops.decode(q, kc, vc, torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lengths))
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k, v = (c[table].flatten(0, 1)[:n] for c in (kc, vc))
        want = _reference(q[i:i + 1], k, v, False)[0][0]
        assert _rel(out[i], want) < (2e-6 if dtype == torch.float32 else 8e-3), (i, n)

    class Cache:
        k, v = [kc], [vc]

    backend = cpu.CPUBackend()
    for _ in range(2):  # the second layer of a step reuses the tables
        assert torch.equal(backend.decode(q, 0, Cache, tables, lengths), out)  # type: ignore[arg-type]
    # Engines sharing a model decode on their own threads: a step on another thread leaves this one's
    # tables (a shared cache failed one engine's decode steps, or read another's blocks).
    mine = backend._tables(tables, lengths)[0]
    others: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: others.append(backend.decode(q[:2], 0, Cache, tables[:2], lengths[:2])))  # type: ignore[arg-type]
    thread.start()
    thread.join()
    assert torch.equal(others[0], out[:2]) and backend._tables(tables, lengths)[0] is mine
    with pytest.raises(RuntimeError, match="outside its table"):
        cpu._ops.decode(q[:1], kc, vc, torch.tensor([[0]]), torch.tensor([block_size + 1]))
    with pytest.raises(RuntimeError, match="block out of range"):
        cpu._ops.decode(q[:1], kc, vc, torch.tensor([[blocks]]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="at least one token and KV head"):  # not a division by zero
        empty = torch.zeros(blocks, block_size, 0, head_dim, dtype=dtype)
        cpu._ops.decode(q[:1], empty, empty, torch.tensor([[0]]), torch.tensor([1]))


def test_empty_inputs_and_refusals() -> None:
    _skip_unless_built(torch.float32)
    q, k = torch.randn(0, 4, 32), torch.randn(5, 2, 32)
    assert cpu.attention(q, k, k, False)[0].shape == (0, 4, 32)
    out, lse = cpu.attention(torch.randn(3, 4, 32), torch.randn(0, 2, 32), torch.randn(0, 2, 32), False)
    assert not out.any() and torch.isneginf(lse).all()
    with pytest.raises(RuntimeError, match="head size 48 is not built"):
        cpu.attention(torch.randn(3, 4, 48), torch.randn(3, 2, 48), torch.randn(3, 2, 48), False)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu.attention(torch.randn(3, 3, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32), False)
    with pytest.raises(RuntimeError, match="at least as many keys"):
        cpu.attention(torch.randn(4, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32), True)
    with pytest.raises(RuntimeError, match="float16"):
        h = torch.randn(3, 2, 32, dtype=torch.float16)
        cpu.attention(h, h, h, False)


def test_the_backend_is_chosen_on_a_cpu_where_it_runs() -> None:
    _skip_unless_built(torch.float32)
    assert select_backend("auto", torch.device("cpu"), torch.float32, 32).name == "cpu"
    assert select_backend("auto", torch.device("cpu"), torch.float32, 48).name == "sdpa"  # not built for 48
    assert select_backend("sdpa", torch.device("cpu"), torch.float32, 32).name == "sdpa"
    with pytest.raises(ValueError, match="cpu attention backend head size 48"):
        select_backend("cpu", torch.device("cpu"), torch.float32, 48)


def test_the_kernels_run_on_torchs_threads() -> None:
    """at::parallel_for is an OpenMP pragma in ATen's headers: a build without -fopenmp ran every tile on
    one thread whatever torch.set_num_threads said (the attention of a 2K-token prompt took as long on two
    threads as on one). The kernels' loops must use exactly torch's thread count, and torch's own libgomp."""
    _skip_unless_built(torch.float32)
    before = torch.get_num_threads()
    try:
        for threads in {1, 2, before}:
            torch.set_num_threads(threads)
            assert cpu.parallel_width(64) == threads
    finally:
        torch.set_num_threads(before)


def test_a_lock_left_by_a_stopped_build_is_removed(tmp_path: Path) -> None:
    """torch's builder waits without end for a `lock` file that a process killed mid-build left."""
    from engine.attention.cpu import _no_stale_lock

    (tmp_path / "lock").touch()
    with _no_stale_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
