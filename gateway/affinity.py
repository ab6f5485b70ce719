"""Prefix affinity: requests that start alike go to the same worker, where their prefix is cached.

Each worker caches the KV of the prompts it served (engine/kv_cache.py); a conversation's next turn,
or another request with the same long system prompt, finds it only on the worker that computed it.
Least-backlog routing alone spreads a conversation's turns over the workers, each computing the
whole history again. The key here is a hash of a request's first characters (its prompt, its chat
messages in order, or its first token ids); the worker is the key's rendezvous choice among the live
ones (so a worker leaving or joining moves only its own keys), unless that worker's predicted
backlog is past the least loaded one's by more than a slack: an SLO outweighs a cache hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import msgspec

CHARS_PER_TOKEN = 4  # a token id counts as this many characters of text


def prefix_key(body: dict[str, Any], chars: int) -> bytes | None:
    """A hash of the request's first `chars` characters, or None when it is shorter (nothing long
    enough to be worth pinning) or `chars` is 0 (affinity off)."""
    if chars <= 0:
        return None
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(messages, list):
        text = "".join(f"{m.get('role')}\x00{_content(m.get('content'))}\x00" for m in messages if isinstance(m, dict))
        head = text[:chars] if len(text) >= chars else None
    elif isinstance(prompt, str):
        head = prompt[:chars] if len(prompt) >= chars else None
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):  # token ids
        n = -(-chars // CHARS_PER_TOKEN)
        head = ",".join(map(str, prompt[:n])) if len(prompt) >= n else None
    else:  # a one-element list of a prompt and the like: no affinity
        head = None
    return None if head is None else hashlib.blake2b(head.encode(), digest_size=16).digest()


def _content(content: Any) -> str:
    return content if isinstance(content, str) else msgspec.json.encode(content).decode()


class HasURL(Protocol):
    url: str


W = TypeVar("W", bound=HasURL)


def rendezvous(key: bytes, workers: Sequence[W]) -> W:
    """The key's worker: highest hash of (key, url). Stable as workers come and go."""
    return max(workers, key=lambda w: hashlib.blake2b(key + w.url.encode(), digest_size=8).digest())
