"""`flowprefill bench prefill` end to end at toy sizes: every section runs and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main


def test_prefill_bench_smoke(tmp_path: Path) -> None:
    assert main(["bench", "prefill", "--quick", "--sizes", "256", "--overhead-sizes", "512", "--stop-sizes", "512",
                 "--repeats", "1", "--stop-samples", "3", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "prefill.json").read_text())
    tput = doc["throughput"]
    assert set(tput["contenders"]) == {"ours unsplit", "ours preemptible", "transformers"}
    assert all(v > 0 for per in tput["tokens_per_s"].values() for v in per.values())
    # GFLOP/s of each contender beside the machine's measured matmul peak
    assert tput["matmul_peak_gflops"] > 0 and tput["gflops"]["ours preemptible"]["256"] > 0
    # Same weights, same answer: the three forwards agree on the last-token logits.
    assert all(v < 1e-4 for k, v in tput["agreement"].items() if k.startswith("max_abs_logit_diff"))
    per = doc["overhead"]["per_size"]["512"]
    # on a CPU each run's CPU seconds too (what the split costs the machine, whatever shares its cores)
    assert len(per["preemptible_cpu_s"]) == len(per["off_cpu_s"]) == 1 and min(per["off_cpu_s"]) > 0
    assert per["median_paired_cpu_overhead_pct"] == per["cpu_overhead_pct"]  # one pair: the same ratio
    split = doc["stop_latency"]["modes"]["split"]["512"]
    assert split["n"] >= 1 and all(ms >= 0 for ms in split["samples_ms"])
    # the engine's learned corrections: the 32-token urgent batches, at least, were measured
    correction = doc["stop_latency"]["modes"]["split"]["correction"]
    assert correction["batches"][0] >= 1 and len(correction["factor"]) == len(correction["size_classes"])
    assert (tmp_path / "prefill.png").stat().st_size > 10_000


def _fast_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic (AVX-512 BF16 or AMX): without, torch's bf16 matmul ran 27x
    slower than fp32 here (2.9 against 79 GFLOP/s on an AVX2 EPYC) and this test passed its 300 s timeout."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


@pytest.mark.skipif(not _fast_bf16(), reason="no bf16 arithmetic on this CPU (AVX-512 BF16 / AMX)")
def test_prefill_bench_on_a_checkpoint_in_bfloat16(tmp_path: Path) -> None:
    """--model/--dtype: a random checkpoint of a published model's structure (llama3 RoPE, GQA,
    untied head), written by transformers, benchmarked against transformers on the same weights."""
    from engine.bench.random_checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint("tiny-llama", tmp_path / "ckpt", dtype="bfloat16")
    out = tmp_path / "out"
    assert main(["bench", "prefill", "--quick", "--sizes", "256", "--repeats", "1", "--sections", "throughput",
                 "--model", str(ckpt), "--dtype", "bfloat16", "--out", str(out)]) == 0
    doc = json.loads((out / "prefill.json").read_text())
    assert doc["config"]["model"]["num_key_value_heads"] == 1
    assert doc["config"]["model"]["rope_scaling"]["rope_type"] == "llama3"
    assert doc["config"]["engine_config"]["dtype"] == "bfloat16"
    assert doc["throughput"]["transformers_setup"]["dtype"] == "bfloat16"
    # bfloat16 rounding differs between the two forwards (fused projections, op order), not more.
    diffs = [v for k, v in doc["throughput"]["agreement"].items() if k.startswith("max_abs_logit_diff")]
    assert diffs and max(diffs) < 0.05


def test_overhead_section_compares_staircase_blocks_with_a_line(tmp_path: Path, monkeypatch) -> None:
    """Where calibration timed a row-block staircase (CUDA by default; asked for here on the CPU),
    the overhead section also runs the split with blocks sized from the per-row rate."""
    from engine.bench import prefill
    from engine.model import calibration

    monkeypatch.setattr(prefill, "load_cost", lambda model: calibration.calibrate(model, block_rows=(32, 64, 96, 128)))
    # A small step budget: on a fast core (oneDNN's projections) 512 tokens fit 2 ms steps unsplit.
    assert main(["bench", "prefill", "--quick", "--overhead-sizes", "512", "--repeats", "1", "--step-budget-ms",
                 "0.25", "--sections", "overhead", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "prefill.json").read_text())
    per = doc["overhead"]["per_size"]["512"]
    assert len(per["linear_blocks_s"]) == 1 and per["steps_linear_blocks"] > per["steps_off"]
    assert [rows for rows, _ in doc["config"]["calibration"]["row_block_s"]["ffn"]] == [32, 64, 96, 128]


def test_prefill_flops_count_a_full_forward() -> None:
    """Against torch's own FLOP counter on transformers' eager forward of the embedded model's shape,
    whose attention computes every query-key pair: the count takes the causal half (n(n+1)/2 pairs)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.core.config import ModelConfig
    from loadtest.flops import prefill_flops

    cfg, n = ModelConfig(), 64
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                                      num_attention_heads=cfg.num_attention_heads,
                                      num_key_value_heads=cfg.num_key_value_heads, attn_implementation="eager"))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(torch.zeros(1, n, dtype=torch.long), logits_to_keep=1)
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    assert prefill_flops(cfg, n) == counter.get_total_flops() - per_pair * (n * n - n * (n + 1) / 2)
