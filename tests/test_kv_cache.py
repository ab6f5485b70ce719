"""KVCache: block accounting, OutOfBlocks, slot mapping, write/gather round trips."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.core.config import ModelConfig
from engine.core.kv_cache import KVCache, OutOfBlocks

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, name="kv-test")


def make_kv(block_size: int = 4, capacity: int = 64) -> KVCache:
    return KVCache(CFG, block_size, capacity, torch.float32, "cpu")


def test_construction_shapes_and_validation() -> None:
    kv = make_kv(block_size=4, capacity=66)  # a partial block of capacity is not a block
    assert kv.num_blocks == 16
    assert kv.block_size == 4
    assert len(kv.k) == len(kv.v) == CFG.num_hidden_layers
    for t in (*kv.k, *kv.v):
        assert t.shape == (16, 4, CFG.num_key_value_heads, CFG.head_dim)
        assert t.dtype == torch.float32
    assert kv.num_free_blocks == 16
    assert kv.usage == 0.0
    with pytest.raises(ValueError):
        make_kv(block_size=0, capacity=64)
    with pytest.raises(ValueError):
        make_kv(block_size=16, capacity=15)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (64, 16)])
def test_blocks_for(tokens: int, blocks: int) -> None:
    assert make_kv(block_size=4).blocks_for(tokens) == blocks


def test_allocate_free_and_usage_accounting() -> None:
    kv = make_kv(block_size=4, capacity=64)  # 16 blocks
    a = kv.allocate(10)  # 3 blocks
    assert len(a) == 3
    assert kv.num_free_blocks == 13
    assert kv.usage == pytest.approx(3 / 16)
    b = kv.allocate(4)  # exactly one block
    c = kv.allocate(0)  # nothing
    assert len(b) == 1
    assert c == []
    assert kv.num_free_blocks == 12
    assert kv.usage == pytest.approx(4 / 16)
    assert len(set(a) | set(b)) == 4, "two requests were given the same block"
    assert all(0 <= i < kv.num_blocks for i in a + b)
    assert kv.can_allocate(48)
    assert not kv.can_allocate(49)

    kv.free(a)
    assert a == [], "free() must clear the caller's block table (so a second free is a no-op)"
    assert kv.num_free_blocks == 15
    kv.free(a)  # double free through the same (now empty) table changes nothing
    assert kv.num_free_blocks == 15
    kv.free(b)
    assert kv.num_free_blocks == 16
    assert kv.usage == 0.0

    # Everything can be taken again, and no id is handed out twice.
    everything = kv.allocate(64)
    assert sorted(everything) == list(range(16))
    assert kv.usage == 1.0
    assert kv.num_free_blocks == 0


def test_out_of_blocks_takes_nothing() -> None:
    kv = make_kv(block_size=4, capacity=32)  # 8 blocks
    held = kv.allocate(20)  # 5 blocks
    assert issubclass(OutOfBlocks, RuntimeError)
    with pytest.raises(OutOfBlocks):
        kv.allocate(13)  # 4 blocks > 3 free
    assert kv.num_free_blocks == 3, "a failed allocation must not leak blocks"
    rest = kv.allocate(12)
    assert len(rest) == 3
    with pytest.raises(OutOfBlocks):
        kv.allocate(1)
    kv.free(held)
    kv.free(rest)
    assert kv.num_free_blocks == kv.num_blocks


def test_slots_mapping() -> None:
    kv = make_kv(block_size=4, capacity=64)
    table = [5, 2, 7]
    expected = [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert kv.slots(table, 0, 12).tolist() == expected
    assert kv.slots(table, 3, 9).tolist() == expected[3:9]
    assert kv.slots(table, 6, 7).tolist() == [10]
    assert kv.slots(table, 4, 4).tolist() == []
    assert kv.slots(table, 0, 12).dtype == torch.long


def test_write_gather_round_trip() -> None:
    torch.manual_seed(0)
    kv = make_kv(block_size=4, capacity=64)
    shape = (CFG.num_key_value_heads, CFG.head_dim)
    a = kv.allocate(11)
    b = kv.allocate(7)
    data = {}
    for name, table, n in (("a", a, 11), ("b", b, 7)):
        for layer in range(CFG.num_hidden_layers):
            k, v = torch.randn(n, *shape), torch.randn(n, *shape)
            # write in two uneven pieces, crossing a block boundary
            cut = 6 if n > 6 else 1
            kv.write(layer, kv.slots(table, 0, cut), k[:cut], v[:cut])
            kv.write(layer, kv.slots(table, cut, n), k[cut:], v[cut:])
            data[name, layer] = (k, v)
    for name, table, n in (("a", a, 11), ("b", b, 7)):
        for layer in range(CFG.num_hidden_layers):
            k, v = data[name, layer]
            gk, gv = kv.gather(layer, table, n)
            assert gk.shape == (n, *shape)
            assert torch.equal(gk, k) and torch.equal(gv, v)
            # a shorter prefix
            pk, pv = kv.gather(layer, table, 5)
            assert torch.equal(pk, k[:5]) and torch.equal(pv, v[:5])
            # physical placement: token t is at block table[t // bs], offset t % bs
            t = n - 1
            assert torch.equal(kv.k[layer][table[t // 4], t % 4], k[t])
            assert torch.equal(kv.v[layer][table[t // 4], t % 4], v[t])

    # Overwriting one token of `a` changes only that token, in that layer only.
    new_k, new_v = torch.full((1, *shape), 7.0), torch.full((1, *shape), -7.0)
    kv.write(1, kv.slots(a, 9, 10), new_k, new_v)
    gk, gv = kv.gather(1, a, 11)
    k, v = data["a", 1]
    assert torch.equal(gk[9], new_k[0]) and torch.equal(gv[9], new_v[0])
    assert torch.equal(gk[:9], k[:9]) and torch.equal(gk[10:], k[10:])
    for layer in (0, 2):
        assert torch.equal(kv.gather(layer, a, 11)[0], data["a", layer][0])
    for layer in range(CFG.num_hidden_layers):
        assert torch.equal(kv.gather(layer, b, 7)[0], data["b", layer][0])

    # Blocks that nobody owns stay untouched (zeros).
    unused = sorted(set(range(kv.num_blocks)) - set(a) - set(b))
    for layer in range(CFG.num_hidden_layers):
        assert not kv.k[layer][unused].any() and not kv.v[layer][unused].any()


def test_concurrent_allocate_free_never_shares_a_block() -> None:
    kv = make_kv(block_size=1, capacity=256)
    seen: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            for _ in range(200):
                try:
                    table = kv.allocate(3)
                except OutOfBlocks:
                    continue
                with lock:
                    seen.append(list(table))
                kv.free(table)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    # Hold some blocks for the whole time: they must never be handed to anyone else.
    pinned = kv.allocate(100)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(not set(t) & set(pinned) for t in seen)
    assert all(len(set(t)) == 3 for t in seen)
    kv.free(pinned)
    assert kv.num_free_blocks == kv.num_blocks
    assert sorted(kv.allocate(256)) == list(range(256))
