"""Decode-side bookkeeping: streaming text, stop strings, EOS and length limits."""

from __future__ import annotations

from engine.request import Request, Sampled, TokenOutput
from engine.tokenizer import ByteTokenizer, HFTokenizer


class OutputStream:
    """Turns a request's sampled tokens into text deltas and decides when it is finished.

    Text that might be the start of a stop string is held back until it is known not to be one,
    so a streamed response never shows a stop string (as OpenAI's API behaves)."""

    def __init__(self, req: Request, tokenizer: ByteTokenizer | HFTokenizer) -> None:
        self.req = req
        self.eos = set() if req.sampling.ignore_eos else set(tokenizer.eos_token_ids)
        self._decoder = tokenizer.incremental_decoder()
        self._pending = ""  # decoded text not yet sent

    def push(self, sampled: Sampled) -> TokenOutput:
        req, token = self.req, sampled.token
        req.output_token_ids.append(token)
        finish = None
        if token in self.eos:
            finish = "stop"
        else:
            self._pending += self._decoder.push(token)
        stops = req.sampling.stop
        cut = min((i for i in (self._pending.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending, finish = self._pending[:cut], "stop"
        if finish is None and len(req.output_token_ids) >= req.sampling.max_tokens:
            finish = "length"
        if finish:
            text, self._pending = self._pending, ""
        else:
            hold = max((_overlap(self._pending, s) for s in stops), default=0)
            text, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold :]
        return TokenOutput(req.request_id, [token], text, finish,
                           logprobs=None if sampled.logprob is None else [sampled.logprob])


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
