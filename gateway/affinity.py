"""Prefix affinity: requests that start alike go to the same worker, where their prefix is cached.

Each worker caches the KV of the prompts it served (engine/core/kv_cache.py); a conversation's next turn,
or another request with the same long system prompt, finds it only on the worker that computed it.
Least-backlog routing alone spreads a conversation's turns over the workers, each computing the
whole history again.

A request's text (its prompt, its chat messages in order, or its token ids) is cut into chunks of
`CHUNK_CHARS` characters, named by chained hashes (a chunk's names its text and all before it). The
pool remembers which worker last took each chunk (`PrefixTable`, least recently used first out): a
request goes to the worker holding its longest recorded prefix (a conversation's next turn, to
where its last turn went), if that prefix is at least `prefix_affinity_chars` long. A request whose
prefix is new goes to the rendezvous choice of its first `prefix_affinity_chars` characters among
the live workers (stable across gateways, and as workers come and go). Either way, load wins when
that worker's predicted backlog is past the least loaded one's by more than a slack: an SLO
outweighs a cache hit. (This is SGLang's cache-aware routing in spirit, with chunks for its radix
tree.)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

CHARS_PER_TOKEN = 4  # a token id counts as this many characters of text
CHUNK_CHARS = 256  # the granularity of recorded prefixes (about 64 tokens)
# Prefixes are told apart up to this many characters (hashing costs ~1 us per chunk on the gateway's
# event loop; a 16 MiB body would take ~90 ms): longer conversations still find their worker by it.
MAX_PREFIX_CHARS = 65_536
TABLE_ENTRIES = 200_000  # chunks remembered per pool (~50M characters of prefixes; ~40 MB)


@dataclass
class Prefix:
    """A request's prefix: `key` hashes its first `prefix_affinity_chars` characters; `chunks` name
    its whole `CHUNK_CHARS` chunks, first to last (chained). `matched_chars`: what routing found."""

    key: bytes
    chunks: list[bytes]
    min_chunks: int  # a recorded match shorter than the key's characters does not count
    matched_chars: int = 0


def prefix_key(body: dict[str, Any], chars: int) -> Prefix | None:
    """The request's prefix, or None when it is shorter than `chars` (nothing long enough to be
    worth pinning) or `chars` is 0 (affinity off)."""
    if chars <= 0:
        return None
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(messages, list):
        text = "".join(f"{m.get('role')}\x00{_content(m.get('content'))}\x00" for m in messages if isinstance(m, dict))
        head = text[:chars] if len(text) >= chars else None
    elif isinstance(prompt, str):
        text = prompt
        head = prompt[:chars] if len(prompt) >= chars else None
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):  # token ids
        n = -(-chars // CHARS_PER_TOKEN)
        text = ",".join(map(str, prompt)) + ","
        head = ",".join(map(str, prompt[:n])) if len(prompt) >= n else None
    else:  # a one-element list of a prompt and the like: no affinity
        return None
    if head is None:
        return None
    return Prefix(hashlib.blake2b(head.encode(), digest_size=16).digest(), _chunk_names(text),
                  -(-len(head) // CHUNK_CHARS))


def _chunk_names(text: str) -> list[bytes]:
    """Chunk i's name: the hash of the text's first i + 1 chunks (one running BLAKE2b, copied at each
    chunk's end; 50 against 65 us for the 32 chunks of an 8K-character prompt when each chunk was
    hashed with its predecessor's name)."""
    n = min(len(text), MAX_PREFIX_CHARS) // CHUNK_CHARS
    data = text[:n * CHUNK_CHARS].encode()
    ascii_text = len(data) == n * CHUNK_CHARS  # then a chunk of characters is the same slice of bytes
    running, names = hashlib.blake2b(digest_size=16), []
    for i in range(n):
        a, b = i * CHUNK_CHARS, (i + 1) * CHUNK_CHARS
        running.update(data[a:b] if ascii_text else text[a:b].encode())
        names.append(running.copy().digest())
    return names


class HasURL(Protocol):
    url: str


W = TypeVar("W", bound=HasURL)


class PrefixTable:
    """Which worker last took each recorded prefix chunk (a pool's memory of where prefixes are
    cached), bounded: the least recently used chunks are forgotten first."""

    def __init__(self, max_entries: int = TABLE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._worker_of: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._worker_of)

    def home(self, prefix: Prefix, live: Sequence[W]) -> W:
        """The live worker holding the request's longest recorded prefix (of at least the key's
        length), else the key's rendezvous choice. Sets `prefix.matched_chars`."""
        by_url = {w.url: w for w in live}
        for n in range(len(prefix.chunks), prefix.min_chunks - 1, -1):
            url = self._worker_of.get(prefix.chunks[n - 1])
            if url is not None and url in by_url:
                prefix.matched_chars = n * CHUNK_CHARS
                return by_url[url]
        prefix.matched_chars = 0
        return rendezvous(prefix.key, live)

    def record(self, prefix: Prefix, url: str) -> None:
        """The request went to `url`: its chunks are cached there now."""
        table = self._worker_of
        for h in prefix.chunks:
            table[h] = url
            table.move_to_end(h)
        while len(table) > self.max_entries:
            table.popitem(last=False)


def _content(content: Any) -> str:
    return content if isinstance(content, str) else msgspec.json.encode(content).decode()


def rendezvous(key: bytes, workers: Sequence[W]) -> W:
    """The key's worker: highest hash of (key, url). Stable as workers come and go."""
    return max(workers, key=lambda w: hashlib.blake2b(key + w.url.encode(), digest_size=8).digest())
