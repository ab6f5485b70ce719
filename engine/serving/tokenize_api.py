"""vLLM's `POST /tokenize` and `POST /detokenize` (evaluation harnesses and clients count and cut
prompts with them), in vLLM's shapes: a `prompt` or chat `messages` (through the chat template, as
chat completions write them) to token ids, with `count` and `max_model_len`; token ids back to text.

`add_special_tokens`: unset, a prompt is tokenized as this server's completions tokenize it (nothing
added, so `count` is the `prompt_tokens` a completion of it reports); true adds what the tokenizer's
post-processor adds (a BOS, for Llama's), as vLLM's default does; messages, as vLLM's, add none by
default (their template writes its own). Detokenizing keeps special tokens, as vLLM's does, so the
ids of a rendered chat come back as its text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, post

from engine.protocol.openai import ChatCompletionRequest
from engine.protocol.tokenize import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from engine.serving.generation import Generation
from engine.serving.endpoint import BadRequest, decode_body


class TokenizeEndpoints:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.tokenizer = generation.engine.tokenizer
        # ids the tokenizer has, or the model's rows (padded past the tokenizer's, which decode to nothing)
        self.vocab_size = max(self.tokenizer.vocab_size, generation.engine.model.cfg.vocab_size)
        self.max_model_len = generation.engine.model.cfg.max_position_embeddings

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = decode_body(await request.body(), TokenizeRequest)
        self.generation.check_model(body.model)
        try:
            ids = self._ids(body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.token_bytes(t).decode("utf-8", errors="backslashreplace")
                                 for t in ids]
        return out

    def _ids(self, body: TokenizeRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("send a prompt or messages (one of them)", param="prompt")
        if body.prompt is not None:
            return self.tokenizer.encode(body.prompt, add_special_tokens=bool(body.add_special_tokens))
        for field in ("continue_final_message", "chat_template"):
            if getattr(body, field):
                raise BadRequest(f"{field} is not supported", param=field, code="unsupported_parameter")
        if not body.messages:
            raise ValueError("messages must not be empty")
        kwargs = ChatCompletionRequest(messages=body.messages, chat_template_kwargs=body.chat_template_kwargs
                                       ).template_kwargs()
        text = self.generation.render(body.messages, body.tools or None, kwargs, body.add_generation_prompt
                                      is not False)
        return self.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))

    async def detokenize(self, request: Request) -> dict[str, str]:
        body = decode_body(await request.body(), DetokenizeRequest)
        self.generation.check_model(body.model)
        if not all(0 <= t < self.vocab_size for t in body.tokens):
            raise BadRequest(f"token ids must be in [0, {self.vocab_size})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def handlers(self) -> list[Any]:
        return [post("/tokenize", status_code=200)(self.tokenize),
                post("/detokenize", status_code=200)(self.detokenize)]
