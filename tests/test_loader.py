"""Checkpoint loading: clear errors for what the engine cannot run, config reading of both
transformers config.json layouts, and the Hugging Face tokenizer (encode/decode, chat template, EOS)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import CHAT_TEMPLATE, CORPUS, EOS_ID, write_tokenizer
from safetensors.torch import load_file, save_file

from engine.core.config import EngineConfig, ModelConfig
from engine.core.tokenizer import DEFAULT_CHAT_TEMPLATE, ByteTokenizer, HFTokenizer, load_tokenizer
from engine.model import load_model
from engine.model.loader import load_checkpoint

pytestmark = pytest.mark.usefixtures("torch_single_thread")

Checkpoints = Callable[[str], Path]


def _copy(tiny_checkpoint: Checkpoints, name: str, dest: Path) -> Path:
    """A private copy of a shared checkpoint, safe to damage."""
    return Path(shutil.copytree(tiny_checkpoint(name), dest / name))


# -- what cannot be loaded -----------------------------------------------------------------------

def test_unsupported_architecture(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "llama", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(EngineConfig(model=str(path)))


def test_no_architectures_names_the_model_type() -> None:
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf({"model_type": "gpt2", "num_attention_heads": 2})


def test_mistral_sliding_window_is_refused() -> None:
    raw = {"architectures": ["MistralForCausalLM"], "sliding_window": 4096, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf(raw)


def test_qwen3_sliding_window_is_refused_and_its_qk_norm_read() -> None:
    raw = {"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(raw)
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16, "use_sliding_window": False}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 16


def test_mlp_bias_is_refused() -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "mlp_bias": True, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(raw)


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(missing)
    with pytest.raises(FileNotFoundError):
        load_model(EngineConfig(model=str(missing)))


def test_missing_config_json(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "qwen2_tied", tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(path)


def test_missing_safetensors(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "qwen2_tied", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_checkpoint(path)


def test_missing_shard(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "llama_sharded", tmp_path)
    shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    (path / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(shards[1])):
        load_checkpoint(path)


def test_sharded_checkpoint_loads_every_tensor(tiny_checkpoint: Checkpoints) -> None:
    path = tiny_checkpoint("llama_sharded")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (path / "model.safetensors").exists()
    _, weights = load_checkpoint(path)
    assert set(weight_map) <= set(weights)


def _rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_tensor_with_wrong_shape(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "qwen2_tied", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(w: dict[str, torch.Tensor]) -> None:
        w[name] = w[name][:-1].contiguous()

    _rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=re.escape(name)):
        load_checkpoint(path)


def test_bias_with_wrong_shape(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "qwen2_tied", tmp_path)
    name = "model.layers.0.self_attn.v_proj.bias"

    def edit(w: dict[str, torch.Tensor]) -> None:
        w[name] = torch.zeros(3)

    _rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=re.escape(name)):
        load_checkpoint(path)


def test_missing_tensor(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "llama", tmp_path)  # untied: lm_head.weight is required
    _rewrite_weights(path, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_checkpoint(path)


# -- config.json, both layouts ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "rope_type", "theta"), [("llama3_rope", "llama3", 500_000.0),
                                                         ("qwen2_yarn", "yarn", 10_000.0)])
def test_rope_parameters_and_legacy_rope_scaling_agree(tiny_checkpoint: Checkpoints, name: str, rope_type: str,
                                                        theta: float) -> None:
    """transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling ({"type": ...})."""
    new = ModelConfig.from_dir(tiny_checkpoint(name))
    old = ModelConfig.from_dir(tiny_checkpoint(f"{name}_legacy"))
    assert "rope_parameters" in json.loads((tiny_checkpoint(name) / "config.json").read_text())
    raw_old = json.loads((tiny_checkpoint(f"{name}_legacy") / "config.json").read_text())
    assert "rope_parameters" not in raw_old and raw_old["rope_scaling"]["type"] == rope_type

    def core(c: ModelConfig) -> tuple:
        keys = ("rope_type", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
        return dataclasses.replace(c, name="", rope_scaling={k: c.rope_scaling.get(k) for k in keys})

    assert core(new) == core(old)
    assert (new.rope_theta, new.rope_scaling["rope_type"]) == (theta, rope_type)


def test_config_fields(tiny_checkpoint: Checkpoints) -> None:
    qwen = ModelConfig.from_dir(tiny_checkpoint("qwen2_tied"))
    assert (qwen.attention_bias, qwen.tie_word_embeddings, qwen.rope_scaling) == (True, True, {})
    assert (qwen.head_dim, qwen.num_key_value_heads, qwen.eos_token_id) == (16, 2, [EOS_ID])
    llama = ModelConfig.from_dir(tiny_checkpoint("llama"))
    assert (llama.attention_bias, llama.tie_word_embeddings, llama.num_key_value_heads) == (False, False, 1)
    assert ModelConfig.from_dir(tiny_checkpoint("llama_bias")).attention_bias


# -- tokenizer ---------------------------------------------------------------------------------------

TEXTS = [*CORPUS, "unseen words: Grüße, Ελληνικά, 日本語 🚀 and tabs\tand\nnewlines"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_hf_tokenizer_round_trip(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir, [EOS_ID], 10_000)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0])  # the trained merges are used


def test_hf_tokenizer_matches_transformers(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer(tok_dir, []), AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 🙂"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_hf_tokenizer_specials_and_eos(tok_dir: Path) -> None:
    tok = HFTokenizer(tok_dir, [EOS_ID])
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(im_start) == len(im_end) == 1
    # the config's eos_token_id and tokenizer_config's eos_token, merged
    assert tok.eos_token_ids == sorted({EOS_ID, im_end[0]})
    assert tok.decode([*im_start, *tok.encode("hello"), *im_end]) == "hello"  # specials skipped
    assert HFTokenizer(tok_dir, []).eos_token_ids == im_end


def test_hf_chat_template_applied(tok_dir: Path) -> None:
    tok = HFTokenizer(tok_dir, [EOS_ID])
    text = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert text == "<s><|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert "bos_token" in CHAT_TEMPLATE  # the template really reads tokenizer_config's special tokens
    ids = tok.encode(text)
    assert ids[:2] == tok.encode("<s>") + tok.encode("<|im_start|>")


def test_hf_tokenizer_without_chat_template(tmp_path: Path) -> None:
    tok = HFTokenizer(write_tokenizer(tmp_path, chat_template=None), [])
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ByteTokenizer().apply_chat_template(messages)
    assert "<|im_start|>" in DEFAULT_CHAT_TEMPLATE


def test_hf_incremental_decoder_streams_the_full_text(tok_dir: Path) -> None:
    tok = HFTokenizer(tok_dir, [])
    for text in TEXTS:
        dec = tok.incremental_decoder()
        pieces = [dec.push(i) for i in tok.encode(text)]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)  # a split multi-byte character is held back


def test_load_model_picks_up_the_checkpoint_tokenizer(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint, "qwen2_tied", tmp_path)
    _, tok = load_model(EngineConfig(model=str(path)))
    assert isinstance(tok, ByteTokenizer)  # no tokenizer.json: the byte fallback
    write_tokenizer(path)
    _, tok = load_model(EngineConfig(model=str(path)))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == sorted({EOS_ID, tok.encode("<|im_end|>")[0]})


# -- what transformers writes or defaults to, read the same way ----------------------------------------

def test_chat_template_jinja_file(tmp_path: Path) -> None:
    """transformers >= 4.50 save_pretrained writes the template to chat_template.jinja, not tokenizer_config."""
    from transformers import AutoTokenizer

    src = write_tokenizer(tmp_path / "src")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved"
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "hello"}]
    assert HFTokenizer(saved, []).apply_chat_template(messages) == HFTokenizer(src, []).apply_chat_template(messages)


def test_missing_tie_word_embeddings_means_untied(tiny_checkpoint: Checkpoints, tmp_path: Path) -> None:
    from transformers import AutoConfig

    path = _copy(tiny_checkpoint, "qwen2_untied", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(raw))
    assert AutoConfig.from_pretrained(path).tie_word_embeddings is False
    assert ModelConfig.from_dir(path).tie_word_embeddings is False  # else lm_head.weight is silently ignored


def test_special_tokens_as_added_token_dicts(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_tokenizer(tmp_path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    for key in ("bos_token", "eos_token", "unk_token"):
        cfg[key] = {"__type": "AddedToken", "content": cfg[key], "lstrip": False, "normalized": False,
                    "rstrip": False, "single_word": False}
    cfg_file.write_text(json.dumps(cfg))
    ours, theirs = HFTokenizer(path, []), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == [theirs.eos_token_id]


def test_chat_template_with_loop_controls(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    path = write_tokenizer(tmp_path, chat_template=template)
    messages = [{"role": "system", "content": "hidden"}, {"role": "user", "content": "hello"}]
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert HFTokenizer(path, []).apply_chat_template(messages) == expected
