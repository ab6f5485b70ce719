"""Tokenizers: the embedded byte-level one and Hugging Face tokenizer.json via `tokenizers`."""

from __future__ import annotations

import codecs
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from jinja2.sandbox import ImmutableSandboxedEnvironment

# A ChatML template, used when a checkpoint ships none. Offered tools are described in the system
# message and calls come back in Qwen2.5's (Hermes') <tool_call> format (--tool-call-parser hermes).
DEFAULT_CHAT_TEMPLATE = """\
{% if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{% for m in messages %}
{% if m['role'] == 'tool' %}
{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{ '\\n<tool_response>\\n' ~ m['content'] ~ '\\n</tool_response>' }}\
{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{% elif m.get('tool_calls') %}
<|im_start|>{{ m['role'] }}{% if m['content'] %}

{{ m['content'] }}{% endif %}{% for call in m['tool_calls'] %}

<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif not (tools and loop.first and m['role'] == 'system') %}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


class _ChatTemplate:
    def __init__(self, template: str | None, special: dict[str, str]) -> None:
        # Templates come with downloaded checkpoints: render them sandboxed, with what
        # transformers offers them (loop controls, tojson without HTML escaping, strftime_now).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self._template = env.from_string(template or DEFAULT_CHAT_TEMPLATE)
        self.chat_template, self.special = template, special  # as given (None: the default template)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """`tools`: OpenAI's tool list as the request gave it (templates read the function schemas);
        `kwargs`: more variables (a request's chat_template_kwargs, such as Qwen3's enable_thinking)."""
        return self._template.render(**(self.special | kwargs), messages=messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt)


def _raise(message: str) -> None:
    raise ValueError(message)


class ByteTokenizer(_ChatTemplate):
    """UTF-8 bytes are tokens 0..255; a few specials follow. Exact token counts for synthesized prompts."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, vocab_size: int = 512) -> None:
        super().__init__(None, {})
        self.vocab_size = vocab_size
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.eos_token_ids = [self.special_ids["<|endoftext|>"], self.special_ids["<|im_end|>"]]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: nothing to add (a byte-level vocabulary has no BOS)."""
        ids: list[int] = []
        for i, part in enumerate(_split_specials(text, self.SPECIALS)):
            if i % 2:
                ids.append(self.special_ids[part])
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return b"".join(map(self.token_bytes, ids)).decode("utf-8", errors="replace")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """What one token stands for: its byte, or a special token's name."""
        if token_id < 256:
            return bytes([token_id])
        return next((s for s, i in self.special_ids.items() if i == token_id), "").encode()

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


def _split_specials(text: str, specials: tuple[str, ...]) -> list[str]:
    """[plain, special, plain, special, ...]"""
    parts, rest = [], text
    while True:
        hits = [(rest.find(s), s) for s in specials if s in rest]
        if not hits:
            parts.append(rest)
            return parts
        pos, special = min(hits)
        parts += [rest[:pos], special]
        rest = rest[pos + len(special) :]


class HFTokenizer(_ChatTemplate):
    """A checkpoint's tokenizer.json (+ tokenizer_config.json for the chat template and EOS), or a
    `tokenizers` Tokenizer built otherwise (`built`: from a GGUF file's metadata)."""

    def __init__(self, path: Path, eos_token_ids: list[int]) -> None:
        from tokenizers import Tokenizer as _Tok

        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special = {k: t for k, v in cfg.items() if k.endswith("_token") and (t := _token_text(v))}
        tok = _Tok.from_file(str(path / "tokenizer.json"))
        eos = list(eos_token_ids)
        if (name := _token_text(cfg.get("eos_token"))) and (tid := tok.token_to_id(name)) is not None:
            eos.append(tid)
        self._setup(tok, _chat_template(path, cfg), special, eos)

    @classmethod
    def built(cls, tok: Any, chat_template: str | None, special: dict[str, str],
              eos_token_ids: list[int]) -> HFTokenizer:
        """`tok`: a tokenizers.Tokenizer; `special`: the `*_token` strings the template may use."""
        self = cls.__new__(cls)
        self._setup(tok, chat_template, special, eos_token_ids)
        return self

    def _setup(self, tok: Any, chat_template: str | None, special: dict[str, str], eos_token_ids: list[int]) -> None:
        self._tok = tok
        spec = json.loads(tok.to_str())
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self._added = {t["id"] for t in spec.get("added_tokens", [])}
        super().__init__(chat_template, special)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = sorted(set(eos_token_ids))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what the tokenizer's post-processor adds (a BOS, for Llama's)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json it was loaded from (as the tokenizers library serializes it)."""
        return self._tok.to_str()

    @functools.cache  # noqa: B019 (one tokenizer per worker, alive as long as it)
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, with nothing dropped by decoding it alone: byte-level BPE
        (GPT-2's, Llama 3's, Qwen2's) pieces mapped back to their bytes, SentencePiece's `▁` as the
        space it is and its byte-fallback pieces `<0x..>` as that byte, added tokens as their text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _token_text(value: object) -> str | None:
    """A special token as configs store it: a string, or (older ones) an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    """transformers' order: chat_template.jinja, then tokenizer_config.json (a string, or a list of
    named templates of which "default" is the chat one)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


class IncrementalDecoder:
    """Streams text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer) -> None:
        self._tok = tokenizer
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        if isinstance(self._tok, ByteTokenizer):
            return self._bytes.decode(bytes([token_id])) if token_id < 256 else ""
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for more
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new


def load_tokenizer(path: Path | None, eos_token_ids: list[int], vocab_size: int) -> ByteTokenizer | HFTokenizer:
    if path is not None and (path / "tokenizer.json").is_file():
        return HFTokenizer(path, eos_token_ids)
    return ByteTokenizer(vocab_size)
