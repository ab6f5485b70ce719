"""Reasoning (thinking) models: the answer's reasoning, written between `<think>` and `</think>`, comes
back apart from its content, as vLLM's `--reasoning-parser` does: in `reasoning_content` (DeepSeek's
and SGLang's name, and vLLM's before 0.11) and `reasoning` (vLLM's since).

- `deepseek_r1` (DeepSeek R1 and its distillations, QwQ): the answer begins in reasoning, whether or
  not it writes the opening tag (R1's template opens it in the prompt); without a closing tag it is
  all reasoning.
- `qwen3` (Qwen3): the answer begins in reasoning when it opens with `<think>` or its prompt ends
  with one (the thinking-only models' templates put it there); `enable_thinking: false` in
  `chat_template_kwargs` gives a prompt whose empty reasoning is already closed, so the answer is
  all content (for either parser). An answer that opened its reasoning but never closed it is all
  reasoning.

Content is everything after the closing tag, as vLLM's (the whitespace a model writes after it
included: a structured output's match must come back whole). Streamed, reasoning and content go out
as they come, with the text that may be the start of a tag held back (as a stop string's is). A
structured output applies to the content only: the matcher starts once the reasoning is closed
(`structured_output.GuidedAnswer`); an answer that may open reasoning or not (`may_open`) decides at its
first token, which may be the constraint's or the opening tag.
"""

from __future__ import annotations

from engine.core.text import prefix_overlap

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(PARSERS)}")
        self.name = name

    def starts_thinking(self, prompt: str) -> bool:
        """Whether an answer to this prompt begins inside its reasoning (before it writes anything):
        never when the prompt closed it already (Qwen3's template with enable_thinking false)."""
        end = prompt.rstrip()
        return not end.endswith(CLOSE) and (self.name == "deepseek_r1" or end.endswith(OPEN))

    def may_open(self, prompt: str) -> bool:
        """Whether an answer to this prompt decides at its first token whether it reasons (by opening
        with `<think>`): qwen3's, when the prompt neither opened nor closed the reasoning."""
        end = prompt.rstrip()
        return self.name == "qwen3" and not end.endswith((OPEN, CLOSE))

    def split(self, text: str, thinking: bool) -> tuple[str | None, str]:
        """The answer's reasoning (None when it has none) and its content. `thinking`: it began in
        reasoning (`starts_thinking`)."""
        body = text.lstrip()
        if body.startswith(OPEN):
            text, thinking = body[len(OPEN):], True
        if not thinking:
            return None, text
        reasoning, _, content = text.partition(CLOSE)
        return reasoning, content


class ReasoningStream:
    """One streamed answer's text, cut into reasoning and content deltas as it grows."""

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser, self.thinking = parser, thinking
        self.opened = False  # an opening tag (or the lack of one) has been decided
        self.text = ""
        self.shown = 0  # how much of `text` has gone out, as reasoning or as content
        self.content_from: int | None = None if thinking else 0  # where content begins in `text`

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The next (reasoning, content) deltas. `final`: the answer ended, nothing is held back."""
        self.text += delta
        if not self.opened:
            body = self.text.lstrip()
            if body.startswith(OPEN):
                self.opened, self.thinking, self.content_from = True, True, None
                self.shown = len(self.text) - len(body) + len(OPEN)
            elif (OPEN.startswith(body) or not body) and not final:
                return "", ""  # may still be the opening tag
            else:
                self.opened = True
        reasoning = ""
        if self.content_from is None:
            end = self.text.find(CLOSE, self.shown)
            if end >= 0:
                reasoning, self.content_from = self.text[self.shown:end], end + len(CLOSE)
                self.shown = self.content_from
            else:
                hold = 0 if final else prefix_overlap(self.text, CLOSE)
                reasoning = self.text[self.shown:len(self.text) - hold]
                self.shown = len(self.text) - hold
                return reasoning, ""
        content = self.text[self.shown:]
        self.shown = len(self.text)
        return reasoning, content
