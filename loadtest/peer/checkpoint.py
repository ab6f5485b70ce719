"""The checkpoint every contender of `flowprefill bench peer` serves: the embedded model (Qwen2 shape:
hidden 256, 4 layers, 8 heads, 2 KV heads, intermediate 704, vocabulary 512, its seeded weights) as
a Hugging Face directory, with a byte-level tokenizer.json whose ids are the embedded tokenizer's
(byte b is token b; <|endoftext|> 256, <|im_start|> 257, <|im_end|> 258), so vLLM and SGLang load
it like any download and a synthesized prompt is the same token ids for every server.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.core.tokenizer import bytes_to_unicode  # the alphabet engine/core/tokenizer.py decodes with

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256.. as engine/core/tokenizer.py's ByteTokenizer
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_json() -> dict[str, object]:
    """A byte-level BPE with no merges: exactly one token per byte, ids equal to the byte."""
    vocab = {c: b for b, c in bytes_to_unicode().items()}
    specials = [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_checkpoint(out: Path, seed: int = 0) -> Path:
    """The embedded model's config.json + model.safetensors (fp32; each server casts to its --dtype)
    and the tokenizer files, in `out` (created)."""
    from engine.model.loader import save_checkpoint, tiny_model

    cfg, weights = tiny_model(seed)
    save_checkpoint(cfg, weights, out)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": cfg.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg.eos_token_id}))
    return out
