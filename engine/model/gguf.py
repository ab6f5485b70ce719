"""Load a GGUF file (llama.cpp's format) of a Llama, Qwen2 or Qwen3 model: its ModelConfig from the
metadata, its weights dequantized under the Hugging Face names the engine reads, and its tokenizer
rebuilt with `tokenizers`, as transformers' GGUF loader does (modeling_gguf_pytorch_utils.py,
integrations/gguf/gguf_tokenizer_mapping.py), so that both give the same logits and token ids."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from engine.core.config import ModelConfig
from engine.core.tokenizer import HFTokenizer, bytes_to_unicode
from engine.model.loader import check_weights, expected_shapes

log = logging.getLogger("flowprefill.engine")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MODEL_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}  # gguf's enum, by its name

Q = GGMLQuantizationType
# What gguf.quants dequantizes with numpy at a few hundred MB/s; its I-quants (IQ*) take minutes for a
# small model, and so are refused.
QUANTIZATIONS = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K,
                           Q.Q5_K, Q.Q6_K})

# The pre-tokenizer split of tokenizer.ggml.pre (llama.cpp's names), transformers' regexes; None: GPT-2's
# own (ByteLevel's regex). smollm's (llama.cpp splits digits apart first) is GPT-2's in transformers too,
# and gives the same tokens, since SmolLM's vocabulary has no token with a digit beside anything else.
# Another name is refused: with the wrong split the merges still apply, to other pieces, and the model
# reads text it was not trained on.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt2": None, "smollm": None,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
# End-of-turn tokens (llama.cpp's list of the common ones): a chat answer ends at the one its chat
# template writes after each turn, which need not be tokenizer.ggml.eos_token_id.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


class Metadata:
    """A GGUF file's key-value metadata, read by key, with the file's name in every error."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader, self.name = reader, path.name
        self._read: dict[str, Any] = {}  # the vocabulary is read more than once, and is 50-150K strings

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._read:
            field = self.reader.get_field(key)
            self._read[key] = None if field is None else field.contents()
        return default if self._read[key] is None else self._read[key]

    def need(self, key: str) -> Any:
        if (value := self.get(key)) is None:
            raise ValueError(f"{self.name}: no {key!r} in its metadata")
        return value


def load_gguf(path: str | Path, cache: Path | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], HFTokenizer]:
    """The model in a GGUF file: its config, its weights (float32, Hugging Face names) and its tokenizer.
    ValueError, in one line naming it, for an architecture, quantization or tokenizer it cannot run.
    `cache`: a folder where the conversion is kept, keyed by the file's name, size and time, and read
    back by a later load: gguf's reader parses every metadata string in Python (2-3 s for SmolLM2's
    49K tokens and merges, of its 4-5 s load), safetensors maps the result in a fraction of a second."""
    path = Path(path)
    stat = path.stat()
    kept = cache / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CACHE_VERSION}" if cache is not None else None
    if kept is not None and (kept / "meta.json").is_file():
        try:
            return _read_kept(kept)
        except Exception as exc:  # a damaged copy (safetensors' own error type too): made again
            log.warning("%s: converted copy unreadable (%s); converting again", kept, exc)
            shutil.rmtree(kept, ignore_errors=True)
    reader = GGUFReader(path)
    meta = Metadata(reader, path)
    tokenizer = gguf_tokenizer(meta)  # first: its errors are cheaper than dequantizing
    cfg = model_config(meta, path.stem)
    weights = load_weights(meta, cfg)
    check_weights(cfg, weights)
    if kept is not None:
        _keep(kept, cfg, weights, tokenizer)
    return cfg, weights, tokenizer


CACHE_VERSION = 1  # of the converted copy's layout (and of the conversion: bump when it changes)


def _keep(kept: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: HFTokenizer) -> None:
    """Write the conversion beside the others, whole or not at all (a folder renamed into place)."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=kept.parent) as tmp:
            save_file(weights, str(Path(tmp) / "model.safetensors"))
            (Path(tmp) / "tokenizer.json").write_text(tokenizer.to_json())
            (Path(tmp) / "meta.json").write_text(json.dumps({
                "config": asdict(cfg), "chat_template": tokenizer.chat_template, "special": tokenizer.special,
                "eos_token_ids": tokenizer.eos_token_ids}))
            os.rename(tmp, kept)
            Path(tmp).mkdir()  # for TemporaryDirectory's clean-up, which expects it
    except OSError as exc:  # a full or read-only disk: the next start converts again
        log.warning("could not keep the converted model in %s: %s", kept.parent, exc)


def _read_kept(kept: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], HFTokenizer]:
    meta = json.loads((kept / "meta.json").read_text())
    cfg = ModelConfig(**meta["config"])
    weights = load_file(str(kept / "model.safetensors"))
    check_weights(cfg, weights)
    tok = Tokenizer.from_file(str(kept / "tokenizer.json"))
    return cfg, weights, HFTokenizer.built(tok, meta["chat_template"], meta["special"], meta["eos_token_ids"])


def model_config(meta: Metadata, name: str) -> ModelConfig:
    arch = meta.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{meta.name}: unsupported GGUF architecture {arch!r} (FlowPrefill runs "
                         f"{', '.join(ARCHITECTURES)})")
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{meta.name}: unsupported: a mixture of experts ({arch}.expert_count)")
    if (scaling := meta.get(f"{arch}.rope.scaling.type", "none")) != "none":
        raise ValueError(f"{meta.name}: unsupported: rope scaling {scaling!r} (FlowPrefill reads GGUF files "
                         "without rope scaling)")
    tensors = {t.name for t in meta.reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{meta.name}: unsupported: a rope_freqs tensor (Llama 3.1's rope scaling, as GGUF "
                         "stores it)")
    heads, hidden = int(meta.need(f"{arch}.attention.head_count")), int(meta.need(f"{arch}.embedding_length"))
    tokens = len(meta.need("tokenizer.ggml.tokens"))
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=int(meta.get(f"{arch}.vocab_size", tokens)),
        hidden_size=hidden,
        intermediate_size=int(meta.need(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.need(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        tie_word_embeddings="output.weight" not in tensors,  # transformers' rule
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_token_ids(meta),
        name=name,
    )


def eos_token_ids(meta: Metadata) -> list[int]:
    """tokenizer.ggml.eos_token_id, and the end-of-turn token the chat template writes."""
    tokens = meta.need("tokenizer.ggml.tokens")
    template = meta.get("tokenizer.chat_template") or ""
    ids = {tokens.index(t) for t in END_OF_TURN if t in template and t in tokens}
    if (eos := meta.get("tokenizer.ggml.eos_token_id")) is not None:
        ids.add(int(eos))
    return sorted(ids)


def load_weights(meta: Metadata, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors the engine reads, dequantized to float32 under their Hugging Face names (gguf's own
    name map, the one llama.cpp's converter wrote them with); other tensors are ignored."""
    arch = meta.need("general.architecture")
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], cfg.num_hidden_layers)
    shapes = expected_shapes(cfg)
    hf_name = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in shapes}
    weights: dict[str, torch.Tensor] = {}
    for tensor in meta.reader.tensors:
        name = hf_name.get(tensor.name)
        if name is None:
            continue
        if tensor.tensor_type not in QUANTIZATIONS:
            known = ", ".join(sorted(q.name for q in QUANTIZATIONS))
            raise ValueError(f"{meta.name}: unsupported quantization {tensor.tensor_type.name} (tensor "
                             f"{tensor.name}; FlowPrefill dequantizes {known})")
        # As a plain ndarray: gguf dequantizes a row group at a time, and each slice of numpy's memmap
        # subclass costs a finalizer call (SmolLM2's 272 tensors: 0.57 s instead of 1.05).
        w = gguf.quants.dequantize(tensor.data.view(np.ndarray), tensor.tensor_type)
        if w.size != np.prod(shapes[name]):
            raise ValueError(f"{meta.name}: tensor {tensor.name} has {w.size} values, its config implies "
                             f"{shapes[name]}")
        w = w.reshape(shapes[name])
        if arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            kv = ".attn_k." in tensor.name
            w = unpermute(w, cfg.num_key_value_heads if kv else cfg.num_attention_heads)
        # A copy: F32 tensors are views of the read-only memory map.
        weights[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    return weights


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's q_proj/k_proj rows (and bias) from the
    rotate-half layout Hugging Face's Llama uses to interleaved pairs (convert_hf_to_gguf.py's
    LlamaModel.permute); the same reshape as transformers' LlamaTensorProcessor._reverse_permute_weights."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_tokenizer(meta: Metadata) -> HFTokenizer:
    """The byte-level BPE tokenizer the metadata describes (tokenizer.ggml.model gpt2: GPT-2's, Llama 3's,
    Qwen2's, SmolLM's), with its chat template, special tokens and end-of-sequence ids."""
    kind = meta.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{meta.name}: unsupported GGUF tokenizer {kind!r} (FlowPrefill builds gpt2's, "
                         "byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{meta.name}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre; FlowPrefill "
                         f"splits as {', '.join(PRE_TOKENIZERS)} do)")
    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
    tok = byte_level_bpe(tokens, meta.need("tokenizer.ggml.merges"), PRE_TOKENIZERS[pre])
    ids = {key: int(i) for key, field in _ID_KEYS.items() if (i := meta.get(f"tokenizer.ggml.{field}")) is not None}
    add_special_tokens(tok, meta, tokens, set(ids.values()))
    if meta.get("tokenizer.ggml.add_bos_token", False) and "bos" in ids:
        # What add_special_tokens=True adds (vLLM's /tokenize, a completion's prompt as Llama 3's are sent).
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1",
                                                           special_tokens=[(bos, ids["bos"])])
    return HFTokenizer.built(tok, meta.get("tokenizer.chat_template"),
                             {f"{key}_token": tokens[i] for key, i in ids.items()}, eos_token_ids(meta))


def byte_level_bpe(tokens: list[str], merges: list[str], split: str | None) -> Tokenizer:
    """GPT-2's BPE over tokens spelled in its byte alphabet (a token spelled otherwise is respelled from
    its UTF-8 bytes, as transformers does); `split`: the regex that cuts text into pieces before the
    merges, None for GPT-2's own."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab, pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                         pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tok.decoder = decoders.ByteLevel()
    return tok


def add_special_tokens(tok: Tokenizer, meta: Metadata, tokens: list[str], ids: set[int]) -> None:
    """Control tokens (and `ids`, the BOS/EOS/UNK/PAD ones) as special tokens, user-defined ones (such as
    `<think>`) as plain added tokens: matched whole in text, never cut by the merges. A token spelled
    outside the byte alphabet is not in the vocabulary as spelled (a control one is a llama.cpp
    mislabel): transformers skips those, and so do we."""
    types = meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(bytes_to_unicode().values())
    control = [t for i, (t, kind) in enumerate(zip(tokens, types, strict=False))
               if (kind == CONTROL and set(t) <= alphabet) or i in ids]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and set(t) <= alphabet]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
