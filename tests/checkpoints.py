"""Tiny random Hugging Face checkpoints and a tokenizer, built offline, for the reference tests.

Every checkpoint is written by transformers' own `save_pretrained`, so the engine reads exactly the
files (config.json layout, tensor names, shards) a real download has. Models are tiny (hidden 64,
2 layers) and every parameter is randomised, norms and biases included, so no term of the forward
can be wrong without the logits showing it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 128
EOS_ID = 2
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
}


def _qwen2(**kw: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**(TINY | kw))


def _llama(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**(TINY | {"tie_word_embeddings": False} | kw))


def _qwen3(**kw: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**(TINY | kw))


def _mistral(**kw: Any) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**(TINY | {"tie_word_embeddings": False, "sliding_window": None} | kw))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 64}

# name -> transformers config. Each exercises a different branch of config reading or of the forward.
CONFIGS: dict[str, Callable[[], Any]] = {
    # q/k/v bias, lm_head tied to the embedding (no lm_head.weight on disk), GQA 4:2
    "qwen2_tied": lambda: _qwen2(tie_word_embeddings=True),
    # untied, multi-head (no grouping: the other path of the attention tile)
    "qwen2_untied": lambda: _qwen2(tie_word_embeddings=False, num_key_value_heads=4),
    # no bias, untied, GQA 4:1
    "llama": lambda: _llama(num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # Llama with attention_bias=true: bias on q/k/v *and* o_proj
    "llama_bias": lambda: _llama(attention_bias=True),
    # Llama 3.1-style rope scaling; theta/head_dim chosen so the wavelengths cover all three bands
    "llama3_rope": lambda: _llama(rope_parameters=dict(LLAMA3_ROPE)),
    # Qwen2.5-style YaRN (attention factor scales cos/sin)
    "qwen2_yarn": lambda: _qwen2(tie_word_embeddings=False, max_position_embeddings=256,
                                 rope_parameters=dict(YARN_ROPE)),
    "mistral": lambda: _mistral(),
    # per-head q/k RMSNorm, no bias, and a head size that is not hidden / heads (4 x 32 = 128 vs 64)
    "qwen3": lambda: _qwen3(head_dim=32, tie_word_embeddings=True),
}


def _quiet() -> None:
    """No "Writing model shards" / "Loading weights" progress bars in the test output."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Every parameter random: matrices N(0, std), norm weights 1 + N(0, 0.1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


def build_checkpoint(kind: str, path: str | Path, *, seed: int = 0, max_shard_size: str | None = None,
                     legacy_rope: bool = False) -> Path:
    """Write a random tiny checkpoint of CONFIGS[kind] to `path` with save_pretrained.

    max_shard_size (e.g. "40KB"): several model-0000i-of-0000n.safetensors + index.json.
    legacy_rope: rewrite config.json the transformers 4.x way (top-level rope_theta + rope_scaling)."""
    from transformers import AutoModelForCausalLM

    _quiet()
    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32)
    randomize_(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if legacy_rope:
        to_legacy_rope_config(path)
    return path


def to_legacy_rope_config(path: Path) -> None:
    """config.json as transformers 4.x wrote it: rope_theta at top level, scaling in rope_scaling
    under the old "type" key (as Qwen2.5's published configs have it)."""
    cfg_file = path / "config.json"
    raw = json.loads(cfg_file.read_text())
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type", "default")
    raw["rope_scaling"] = None if kind == "default" else rope | {"type": kind}
    cfg_file.write_text(json.dumps(raw, indent=2))


def load_reference(path: str | Path) -> Any:
    """transformers' own model on the checkpoint's weights (fp32, eager attention: the plain math)."""
    from transformers import AutoModelForCausalLM

    _quiet()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# -- tokenizer -----------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4: "</s>" is EOS_ID
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizer: byte-level BPE round trips any text",
    "serving engines prefill prompts and decode tokens one at a time",
    "naïve café déjà vu — ünïcödé text 你好 世界 🙂",
]


def write_tokenizer(path: str | Path, vocab_size: int = VOCAB * 3, eos_token: str = "<|im_end|>",
                    chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer.json trained offline on CORPUS, plus tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                           "eos_token": eos_token, "unk_token": "<unk>", "model_max_length": 512}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return path


# -- named variants: a CONFIGS kind plus how it is saved ---------------------------------------

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {kind: (kind, {}) for kind in CONFIGS} | {
    "llama_sharded": ("llama", {"max_shard_size": "40KB", "seed": 1}),
    "llama3_rope_legacy": ("llama3_rope", {"legacy_rope": True, "seed": 2}),
    "qwen2_yarn_legacy": ("qwen2_yarn", {"legacy_rope": True, "seed": 3}),
}


def build_variant(name: str, path: str | Path) -> Path:
    kind, kwargs = VARIANTS[name]
    return build_checkpoint(kind, path, **kwargs)
