"""Structured output: an answer constrained to a JSON schema, a regular expression, a choice of
strings or a grammar (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`, and
forced tool calls). llguidance compiles the constraint into a matcher over the tokenizer's
vocabulary; at each step the matcher says which tokens may come next, the sampler masks the others
(`allowed_logits`), and the matcher follows the sampled token (`advance`). It needs no lookahead
and no rollback, so decode batching, preemption, eviction and hand-off are unchanged: the matcher
lives on the request (`GuidedAnswer`, the engine's `Request.constraint`) and is where its answer left it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.core.tokenizer import ByteTokenizer, HFTokenizer
from engine.protocol.sampling import KINDS, Guide

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("flowprefill.structured_output")


# A constraint whose next mask, or whose step past a token, costs more CPU than this fails alone
# (an ambiguous grammar can grow costlier with every token, and the engine thread waits for it:
# every answer in the batch would). Normal masks take well under a millisecond.
STEP_CPU_LIMIT_S = 0.02


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
                # oneOf as anyOf, as vLLM's default backend reads it (pydantic writes unions so)
                options: dict[str, Any] = {"whitespace_flexible": guide.any_whitespace, "coerce_one_of": True}
                if guide.whitespace_pattern is not None:
                    options["whitespace_pattern"] = guide.whitespace_pattern
                grammar = llguidance.LLMatcher.grammar_from_json_schema(guide.spec, defaults=options)
            else:
                grammar = llguidance.grammar_from(guide.kind, guide.spec)
        except (ValueError, TypeError, RecursionError) as exc:  # a grammar that does not convert, a choice
            # list that is not JSON, a schema nested past what the converter recurses through
            raise ValueError(f"invalid {_NAMES[guide.kind]}: {exc}") from None
        tok = self.lltokenizer()
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if error:
            raise ValueError(f"invalid {_NAMES[guide.kind]}: {messages[0]}")
        # terse errors: llguidance's verbose ones dump the parser's state and the whole grammar
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=llguidance.LLParserLimits(
            verbose_errors=False))
        matcher.compute_bitmask()  # some errors show only here: an empty language, a rule with no end
        if matcher.is_error():
            raise ValueError(f"invalid {_NAMES[guide.kind]}: {_error(matcher)}")
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


def allowed_logits(row: torch.Tensor, matcher: llguidance.LLMatcher, hold: list[int] | None = None,
                   also: list[int] | None = None) -> torch.Tensor:
    """The logits with every token the matcher does not allow next set to -inf. `hold`: tokens to
    leave out too (the end of sequence under ignore_eos), unless nothing else is allowed; `also`:
    tokens to allow besides (a reasoning model's opening tag)."""
    start = time.thread_time()
    bitmask = matcher.compute_bitmask()
    _check(matcher, start, "a token's mask")
    # one bit per token, unpacked straight into bools: runs every token of every constrained answer,
    # and converting the bits after unpacking took three times as long at a 152K vocabulary
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little",
                         count=row.numel()).view(np.bool_)
    if hold and bits[hold].any() and bits.sum() > bits[hold].sum():
        bits = bits.copy()
        bits[hold] = False
    if also:
        bits[also] = True
    if not bits.any():
        raise ValueError("the structured output allows no next token")
    return torch.where(torch.from_numpy(bits).to(row.device), row.float(), float("-inf"))


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Follow the sampled token; True when the constraint is complete (nothing but the end may come)."""
    start = time.thread_time()
    if not matcher.consume_token(token):
        raise ValueError(f"the structured output rejected token {token}: {_error(matcher)}")
    _check(matcher, start, "a token's step")
    return matcher.is_stopped()


def _check(matcher: llguidance.LLMatcher, start: float, what: str) -> None:
    """llguidance never raises for a grammar's trouble: its matcher enters an error state, where it
    would allow only the end (an answer ending as if complete). Here the trouble is an error."""
    if matcher.is_error():
        raise ValueError(f"the structured output failed: {_error(matcher)}")
    if (spent := time.thread_time() - start) > STEP_CPU_LIMIT_S:
        raise ValueError(f"the structured output is too costly to follow: {what} took {spent * 1000:.0f} ms "
                         f"of CPU (at most {STEP_CPU_LIMIT_S * 1000:.0f})")


class GuidedAnswer:
    """An answer's structured output as the engine follows it (engine/core/sampling.py's TokenConstraint):
    its matcher, and for a reasoning model (engine/serving/reasoning.py) the reasoning before the content,
    where the constraint does not apply yet. `thinking_until`: the text that closes the reasoning
    the answer begins in (None: it begins in content); `opens_thinking`: the tokens that open it,
    allowed beside the constraint's at the first token only (an answer that decides there whether it
    reasons), `close` then being what closes it."""

    def __init__(self, matcher: llguidance.LLMatcher, thinking_until: str | None = None,
                 opens_thinking: list[int] | None = None, close: str = "") -> None:
        self.matcher, self.thinking_until, self.close = matcher, thinking_until, close
        self.opens_thinking = opens_thinking or []
        self._thought = ""  # the reasoning's last characters, where its closing tag is looked for

    def mask(self, row: torch.Tensor, hold: list[int] | None) -> torch.Tensor:
        if self.thinking_until is not None:  # reasoning: anything goes until it is closed
            return row
        return allowed_logits(row, self.matcher, hold, self.opens_thinking)

    def accept(self, token: int, text: str) -> bool:
        if self.opens_thinking:  # its first token: reasoning, or what its structured output allows
            self.thinking_until = self.close if token in self.opens_thinking else None
            self.opens_thinking = []
        if self.thinking_until is None:
            return advance(self.matcher, token)
        seen = self._thought + text  # the constraint starts after the closing tag
        if self.thinking_until in seen:
            self.thinking_until = None
        self._thought = seen[-len(self.thinking_until or ""):]
        return False


def failed_by_constraint(error: str) -> bool:
    """Whether an answer's error came from its structured output (the client's constraint: a 400,
    not a server error, though it showed only while generating)."""
    return "the structured output" in error


def _error(matcher: llguidance.LLMatcher) -> str:
    return (matcher.get_error() or "unknown error").strip().splitlines()[0]
