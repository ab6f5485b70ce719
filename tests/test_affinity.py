"""Prefix affinity (gateway/affinity.py, gateway/routing.py): the key, the worker it picks, and the
slack past which load wins; end to end, a conversation over two workers finds its history cached."""

from __future__ import annotations

import httpx
import openai
import pytest
from processes import serving

from gateway.affinity import prefix_key, rendezvous
from gateway.config import Upstream
from gateway.routing import Worker, WorkerPool


def test_the_key_is_the_first_characters() -> None:
    long, other = "x" * 1500, "x" * 1023 + "y" + "x" * 476
    assert prefix_key({"prompt": long}, 1024) == prefix_key({"prompt": long + " more"}, 1024)
    assert prefix_key({"prompt": long}, 1024) != prefix_key({"prompt": other}, 1024)
    assert prefix_key({"prompt": "x" * 1000}, 1024) is None  # too short to pin
    assert prefix_key({"prompt": long}, 0) is None  # off
    turn1 = [{"role": "system", "content": "s" * 1100}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    assert prefix_key({"messages": turn1}, 1024) == prefix_key({"messages": turn2}, 1024) is not None
    parts = [{"role": "user", "content": [{"type": "text", "text": "p" * 1100}]}]
    assert prefix_key({"messages": parts}, 1024) is not None
    ids = list(range(300))
    assert prefix_key({"prompt": ids}, 1024) == prefix_key({"prompt": [*ids, 5]}, 1024) is not None
    assert prefix_key({"prompt": ids[:255]}, 1024) is None
    assert prefix_key({"prompt": [long]}, 1024) is None and prefix_key({}, 1024) is None


def test_rendezvous_moves_only_the_keys_of_a_worker_that_leaves() -> None:
    workers = [Worker(f"http://w{i}") for i in range(4)]
    keys = [prefix_key({"prompt": f"{i:04d}" * 300}, 1024) for i in range(200)]
    home = {k: rendezvous(k, workers) for k in keys}
    assert len({w.url for w in home.values()}) == 4  # spread over all of them
    gone = workers[1]
    rest = [w for w in workers if w is not gone]
    assert all(rendezvous(k, rest) is home[k] for k in keys if home[k] is not gone)


def pool(kind: str = "flowprefill") -> WorkerPool:
    return WorkerPool(["http://a", "http://b", "http://c"], httpx.AsyncClient(), upstream=Upstream(kind=kind))


def test_the_prefix_worker_wins_within_the_slack() -> None:
    p = pool()
    key = prefix_key({"prompt": "k" * 2000}, 1024)
    assert key is not None
    home = rendezvous(key, p.workers)
    assert all(p.pick(key=key) is home for _ in range(5))  # idle pool: always the same one
    home.backlog_s = 0.2
    assert p.pick(key=key) is home  # busier, within 0.25 s of the least loaded
    home.backlog_s = 0.4
    assert p.pick(key=key) is not home  # past the slack: load wins
    assert p.pick(exclude={home.url}, key=key) is not home  # a retry goes elsewhere
    # no key: least backlog, round robin among equals
    home.backlog_s = 0.0
    assert len({p.pick().url for _ in range(6)}) == 3


def test_a_gated_pool_prefers_a_free_slot_on_the_prefix_server() -> None:
    p = pool("openai")
    key = prefix_key({"prompt": "g" * 2000}, 1024)
    assert key is not None
    home = rendezvous(key, p.workers)
    home.in_flight = 3  # others idle: by load it would not be chosen
    assert p._free(frozenset(), key) is home
    home.in_flight = p.upstream.max_concurrency  # full: any free one
    assert p._free(frozenset(), key) is not home


def conversation(url: str, turns: int = 4) -> list[int]:
    """The cached prompt tokens of each turn of one conversation (a 1,200-byte system prompt)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief and exact. " * 60}]
    cached = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: " + "why? " * 40})
        out = client.chat.completions.create(model="flowprefill-default", messages=messages, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return cached


@pytest.mark.slow
def test_a_conversation_over_two_workers_finds_its_history() -> None:
    """Every turn after the first lands on the worker that served the last (by load alone, idle
    workers take turns, and a turn there finds its history only if it was there before)."""
    with serving("--workers", "2") as url:
        cached = conversation(url)
    assert cached[0] == 0 and all(c >= 1280 for c in cached[1:]), cached
    assert cached == sorted(cached)  # the whole history so far, in 256-token blocks
