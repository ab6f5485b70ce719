"""Structured output: an answer constrained to a JSON schema, a regular expression, a choice of
strings or a grammar (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`, and
forced tool calls). llguidance compiles the constraint into a matcher over the tokenizer's
vocabulary; at each step the matcher says which tokens may come next, the sampler masks the others
(`allowed_logits`), and the matcher follows the sampled token (`advance`). It needs no lookahead
and no rollback, so decode batching, preemption, eviction and hand-off are unchanged: the matcher
lives on the request and is where its answer left it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from engine.tokenizer import ByteTokenizer, HFTokenizer

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("flowprefill.structured_output")
KINDS = ("json", "regex", "choice", "grammar")


class Guide(msgspec.Struct, frozen=True, omit_defaults=True):
    """What an answer must match."""

    kind: str  # one of KINDS
    spec: str  # a JSON schema, a regular expression, a JSON list of strings, or a Lark / GBNF grammar
    # JSON: whitespace may be written between tokens (vLLM's default); off, the JSON is compact, which
    # keeps a weak model from padding its answer with whitespace until max_tokens.
    any_whitespace: bool = True
    whitespace_pattern: str | None = None  # JSON: a regular expression for that whitespace instead

    @classmethod
    def json(cls, schema: Any, **kw: Any) -> Guide:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object")
        return cls("json", json.dumps(schema), **kw)

    @classmethod
    def choice(cls, choices: Any) -> Guide:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices))


class Grammars:
    """Compiles guides into matchers over one model's vocabulary (thread-safe: the HTTP handlers
    compile, the engine thread runs the matchers)."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Build the vocabulary's side in the background (a large vocabulary takes a second), so the
        first constrained request does not wait for it."""
        def build() -> None:
            try:
                self.lltokenizer()
            except Exception:  # the first constrained request will say what is wrong
                log.exception("structured output is not available")
        threading.Thread(target=build, name="flowprefill-grammars", daemon=True).start()

    def lltokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._lltok is None:
                tok = self.tokenizer
                source = (tok.to_json() if isinstance(tok, HFTokenizer)
                          else llguidance.TokenizerWrapper(_Vocabulary(tok, self.vocab_size)))
                self._lltok = llguidance.LLTokenizer(source, n_vocab=self.vocab_size,
                                                     eos_token=list(tok.eos_token_ids))
            return self._lltok

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher at the answer's start. ValueError (a 400) when the constraint is invalid."""
        import llguidance

        if guide.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {guide.kind!r}")
        try:
            if guide.kind == "json":
                options: dict[str, Any] = {"whitespace_flexible": guide.any_whitespace}
                if guide.whitespace_pattern is not None:
                    options["whitespace_pattern"] = guide.whitespace_pattern
                grammar = llguidance.LLMatcher.grammar_from_json_schema(guide.spec, defaults=options)
            else:
                grammar = llguidance.grammar_from(guide.kind, guide.spec)
        except (ValueError, TypeError) as exc:  # a grammar that does not convert, a choice list that is not JSON
            raise ValueError(f"invalid {_NAMES[guide.kind]}: {exc}") from None
        tok = self.lltokenizer()
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if error:
            raise ValueError(f"invalid {_NAMES[guide.kind]}: {messages[0]}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {_NAMES[guide.kind]}: {matcher.get_error()}")
        return matcher


_NAMES = {"json": "JSON schema", "regex": "regular expression", "choice": "choice", "grammar": "grammar"}


class _Vocabulary:
    """A tokenizer without a tokenizer.json (the embedded byte-level one) as llguidance reads it:
    each token id's bytes, and which ids are special (they never appear inside the constrained text)."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(tokenizer.special_ids.values())
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]

    def __call__(self, text: str | bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def allowed_logits(row: torch.Tensor, matcher: llguidance.LLMatcher) -> torch.Tensor:
    """The logits with every token the matcher does not allow next set to -inf."""
    # one bit per token, unpacked straight into bools: runs every token of every constrained answer,
    # and converting the bits after unpacking took three times as long at a 152K vocabulary
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little",
                         count=row.numel()).view(np.bool_)
    if not bits.any():
        raise ValueError(f"the structured output allows no next token: {matcher.get_error() or 'dead end'}")
    return torch.where(torch.from_numpy(bits).to(row.device), row.float(), float("-inf"))


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Follow the sampled token; True when the constraint is complete (nothing but the end may come)."""
    if not matcher.consume_token(token):
        raise ValueError(f"the structured output rejected token {token}: {matcher.get_error()}")
    return matcher.is_stopped()
