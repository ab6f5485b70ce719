"""Prefix affinity (gateway/affinity.py, gateway/routing.py): the key, the worker it picks, and the
slack past which load wins; end to end, a conversation over two workers finds its history cached."""

from __future__ import annotations

import httpx
import openai
import pytest
from processes import needs_engine, serving

from gateway.affinity import CHUNK_CHARS, PrefixTable, prefix_key, rendezvous
from gateway.config import Upstream
from gateway.routing import Worker, WorkerPool

pytestmark = pytest.mark.gateway_only


def key(body: dict, chars: int = 1024) -> bytes | None:
    prefix = prefix_key(body, chars)
    return None if prefix is None else prefix.key


def test_the_key_is_the_first_characters() -> None:
    long, other = "x" * 1500, "x" * 1023 + "y" + "x" * 476
    assert key({"prompt": long}) == key({"prompt": long + " more"})
    assert key({"prompt": long}) != key({"prompt": other})
    assert key({"prompt": "x" * 1000}) is None  # too short to pin
    assert key({"prompt": long}, 0) is None  # off
    turn1 = [{"role": "system", "content": "s" * 1100}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    assert key({"messages": turn1}) == key({"messages": turn2}) is not None
    parts = [{"role": "user", "content": [{"type": "text", "text": "p" * 1100}]}]
    assert key({"messages": parts}) is not None
    ids = list(range(300))
    assert key({"prompt": ids}) == key({"prompt": [*ids, 5]}) is not None
    assert key({"prompt": ids[:255]}) is None
    assert key({"prompt": [long]}) is None and key({}) is None


def test_chunks_name_the_whole_prefix() -> None:
    a, b = prefix_key({"prompt": "a" * 1500}, 1024), prefix_key({"prompt": "a" * 1000 + "b" * 500}, 1024)
    assert a is not None and b is not None
    assert len(a.chunks) == 1500 // CHUNK_CHARS and a.min_chunks == 1024 // CHUNK_CHARS
    assert a.chunks[:3] == b.chunks[:3] and a.chunks[3] != b.chunks[3]  # chunk 3 holds the first "b"
    assert prefix_key({"prompt": "b" + "a" * 1499}, 1024).chunks[-1] != a.chunks[-1]  # chained: the start counts


def test_rendezvous_moves_only_the_keys_of_a_worker_that_leaves() -> None:
    workers = [Worker(f"http://w{i}") for i in range(4)]
    keys = [key({"prompt": f"{i:04d}" * 300}) for i in range(200)]
    home = {k: rendezvous(k, workers) for k in keys}
    assert len({w.url for w in home.values()}) == 4  # spread over all of them
    gone = workers[1]
    rest = [w for w in workers if w is not gone]
    assert all(rendezvous(k, rest) is home[k] for k in keys if home[k] is not gone)


def pool(kind: str = "flowprefill") -> WorkerPool:
    return WorkerPool(["http://a", "http://b", "http://c"], httpx.AsyncClient(), upstream=Upstream(kind=kind))


def test_the_prefix_worker_wins_within_the_slack() -> None:
    p = pool()
    prefix = prefix_key({"prompt": "k" * 2000}, 1024)
    assert prefix is not None
    home = rendezvous(prefix.key, p.workers)
    assert all(p.pick(key=prefix) is home for _ in range(5))  # idle pool: always the same one
    home.backlog_s = 0.2
    assert p.pick(key=prefix) is home  # busier, within 0.25 s of the least loaded
    home.backlog_s = 0.4
    assert p.pick(key=prefix) is not home  # past the slack: load wins
    assert p.pick(exclude={home.url}, key=prefix) is not home  # a retry goes elsewhere
    # no key: least backlog, round robin among equals
    home.backlog_s = 0.0
    assert len({p.pick().url for _ in range(6)}) == 3


def chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages += [{"role": "user", "content": t}] + ([{"role": "assistant", "content": "ok " * 40}]
                                                        if i < len(turns) - 1 else [])
    return {"messages": messages}


def served(p: WorkerPool, body: dict) -> Worker:
    """Route a request as the gateway does: pick, and once the worker answered 200, record it."""
    prefix = prefix_key(body, 1024)
    assert prefix is not None
    w = p.pick(key=prefix)
    assert w is not None
    p.prefixes.record(prefix, w.url)
    return w


def test_a_conversation_that_spilled_over_follows_its_worker() -> None:
    """Conversations sharing a long system prompt start on its worker until that one is busy; one
    that spilled to another worker finds its own history there on its next turn (its longest
    recorded prefix), not on the system prompt's worker."""
    p = pool()
    system = "You are a careful assistant. " * 60  # 1,740 characters
    first = served(p, chat(system, "q1 " * 100))
    first.backlog_s = 1.0
    spilled_key = prefix_key(chat(system, "other " * 100), 1024)
    spilled = served(p, chat(system, "other " * 100))
    assert spilled is not first
    assert p.prefixes.home(spilled_key, p.workers) is spilled  # now recorded there, all of it
    first.backlog_s = 0.0  # idle again: by the system prompt alone the next turn would go back
    turn2 = prefix_key(chat(system, "other " * 100, "and then? " * 20), 1024)
    assert p.pick(key=turn2) is spilled
    assert turn2.matched_chars > len(system)
    again = prefix_key(chat(system, "q1 " * 100, "more " * 30), 1024)
    assert p.pick(key=again) is first  # the first conversation's turn 2 goes home too


def test_a_worker_that_did_not_answer_does_not_take_the_prefix() -> None:
    """Routing records nothing: the gateway records a worker once it answered 200. A turn that every
    worker shed, retried later, still goes where its history is. (Found by review: picking used to
    record, so the last worker to shed took the conversation.)"""
    p = pool()
    home = served(p, chat("You are careful. " * 80, "q1 " * 100))
    turn2 = chat("You are careful. " * 80, "q1 " * 100, "q2 " * 50)
    tried: set[str] = set()
    while (w := p.pick(exclude=tried, key=prefix_key(turn2, 1024))) is not None:
        tried.add(w.url)  # shed there: nothing computed, nothing cached
    assert p.pick(key=prefix_key(turn2, 1024)) is home
    busy = prefix_key(turn2, 1024)
    home.backlog_s = 1.0
    assert p.pick(key=busy) is not home and busy.matched_chars == 0  # load won: no match reported


def test_the_table_forgets_least_recently_used_chunks_first() -> None:
    table = PrefixTable(max_entries=8)
    workers = [Worker("http://a"), Worker("http://b")]
    old, new = prefix_key({"prompt": "o" * 1024}, 1024), prefix_key({"prompt": "n" * 2048}, 1024)
    table.record(old, "http://b")
    table.record(new, "http://a")  # 8 chunks: the old ones go
    assert len(table) == 8
    assert table.home(new, workers).url == "http://a" and new.matched_chars == 2048
    table.home(old, workers)
    assert old.matched_chars == 0  # forgotten: the key's rendezvous choice
    # a worker that left: the longest prefix recorded on a live one, else rendezvous
    assert table.home(new, workers[1:]).url == "http://b" and new.matched_chars == 0


def test_a_gated_pool_prefers_a_free_slot_on_the_prefix_server() -> None:
    p = pool("openai")
    prefix = prefix_key({"prompt": "g" * 2000}, 1024)
    assert prefix is not None
    home = rendezvous(prefix.key, p.workers)
    home.in_flight = 3  # others idle: by load it would not be chosen
    assert p._free(frozenset(), prefix) is home
    home.in_flight = p.upstream.max_concurrency  # full: any free one
    assert p._free(frozenset(), prefix) is not home


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
@needs_engine
def test_a_conversation_over_two_workers_finds_its_history() -> None:
    """Every turn after the first lands on the worker that served the last (by load alone, idle
    workers take turns, and a turn there finds its history only if it was there before)."""
    with serving("--workers", "2") as url:
        cached = conversation(url)
    assert cached[0] == 0 and all(c >= 1280 for c in cached[1:]), cached
    assert cached == sorted(cached)  # the whole history so far, in 256-token blocks
