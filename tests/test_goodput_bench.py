"""`flowprefill bench goodput` end to end on the simulator: the goodput.json schema of
docs/reference.md, a PNG, the files its help names, and a table that says what it measured."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _trace(tmp_path: Path) -> Path:
    rng = random.Random(0)
    trace = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(60):  # an Azure-format fixture: a mix of short and long prompts over 30 s
        n = rng.choice([rng.randint(50, 1000), rng.randint(1500, 2000), rng.randint(3000, 9000)])
        rows.append(f"2023-11-16 18:15:{i // 2:02d}.{(i % 2) * 5}000000,{n},10")
    trace.write_text("\n".join(rows) + "\n")
    return trace


def test_goodput_bench_writes_spec_schema(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "goodput", "--engine", "sim", "--cost", "llama-3.1-8b@h100", "--workload", str(trace),
                 "--rates", "5,20,80", "--slo-scales", "0.5,1.0", "--scale-rate", "20", "--out", str(out)]) == 0
    doc = json.loads((out / "goodput-sim.json").read_text())
    assert {"workload", "engine", "model", "slo_scale", "attainment_target", "classes", "policies",
            "ratios"} <= set(doc)
    assert doc["engine"] == "sim" and doc["workload"]["requests"] == 60 and doc["workload"]["class_rule"]
    assert set(doc["policies"]) == {"flowprefill", "fcfs", "chunked:2048", "chunked:8192", "flowprefill-ideal"}
    for pol in doc["policies"].values():
        assert {"max_goodput_rps", "max_goodput_per_class_rps", "points"} <= set(pol)
        for p in pol["points"]:
            assert {"rate", "attainment", "goodput_rps", "per_class", "preemptions"} <= set(p)
            for c in p["per_class"].values():
                assert {"n", "attainment", "ttft_p50_ms", "ttft_p99_ms"} <= set(c)
    assert "flowprefill/fcfs" in doc["ratios"]
    assert (out / "goodput-sim.png").stat().st_size > 10_000


def _json_strict(path: Path) -> dict:
    """JSON as the standard has it: Infinity and NaN (what json.dumps writes for inf) are refused."""
    def refuse(name: str) -> None:
        raise ValueError(f"{path.name}: {name} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_goodput_bench_below_every_rate_and_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """At a rate no policy sustains, the table says "below 1000" (not 0.00), the ratios are null (not
    inf, and 0/0 is no ratio); the files are the ones `--help` and the reference page name, and the
    table, printed to a pipe, is not cut at 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = tmp_path / "out"
    assert main(["bench", "goodput", "--engine", "sim", "--cost", "llama-3.1-8b@h100", "--workload",
                 str(_trace(tmp_path)), "--rates", "1000", "--slo-scales", "", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = _json_strict(out / "goodput-sim.json")
    assert all(p["max_goodput_rps"] == 0.0 for p in doc["policies"].values())
    assert all(p["max_goodput_note"] == "below 90 % at every rate" for p in doc["policies"].values())
    assert doc["ratios"] and all(v is None for v in doc["ratios"].values())
    assert "inf" not in printed and "0.00" not in printed
    rows = [line for line in printed.splitlines() if re.match(r"│ +fcfs │", line)]
    assert len(rows) == 1 and rows[0].count("below 1000") == 2, printed
    assert "n/a (baseline below every rate)" in printed
    assert "below R: attainment below 90 % at every rate, down to the lowest, R" in printed  # under the table
    header = next(line for line in printed.splitlines() if "max goodput req/s" in line)
    assert "every class >= 90 %" in header and "tightest SLO scale" in header, printed  # one line, uncut
    assert sorted(p.name for p in out.iterdir()) == ["goodput-sim.json", "goodput-sim.png"]

    helped = io.StringIO()
    with contextlib.redirect_stdout(helped), pytest.raises(SystemExit):
        main(["bench", "goodput", "--help"])
    assert "<out>/goodput-<engine>.json" in " ".join(helped.getvalue().split())
    reference = (ROOT / "docs" / "reference.md").read_text()
    row = next(line for line in reference.splitlines() if line.startswith("| `flowprefill bench goodput"))
    assert "`<out>/goodput-<engine>.json`" in row and "`<out>/goodput-<engine>.png`" in row
    assert re.search(r"^\| `flowprefill loadtest` .*`<out>/goodput\.json`", reference, re.M)


def test_goodput_bench_under_prediction_error(tmp_path: Path) -> None:
    """`--errors`: every policy swept under each injected error, FlowPrefill against the best baseline."""
    import pytest

    out = tmp_path / "out"
    assert main(["bench", "goodput", "--engine", "sim", "--cost", "llama-3.1-8b@h100", "--requests", "200",
                 "--rates", "10,40", "--policies", "flowprefill,fcfs", "--errors", "none,bias:0.2,slowdown:3",
                 "--out", str(out)]) == 0
    doc = json.loads((out / "goodput-sim-errors.json").read_text())
    assert set(doc["levels"]) == {"none", "bias:0.2", "slowdown:3"}
    for level in doc["levels"].values():
        assert set(level["policies"]) == {"flowprefill", "fcfs"}
        assert level["flowprefill/best"]["best"] == "fcfs" and "flowprefill/best, every class" in level
        fp = level["policies"]["flowprefill"]
        assert {"max_goodput_rps", "max_goodput_per_class_rps", "p99_over_target_at_knee", "points"} <= set(fp)
    conv = doc["levels"]["slowdown:3"]["convergence"]  # the correction after the step, batch by batch
    assert conv["rate"] == 10 and conv["batches_after"] > 10 and len(conv["errors"]) == len(conv["tokens"])
    assert conv["batches_to_converge"] is not None and conv["batches_to_converge"] <= 5, conv["errors"]
    assert "convergence" not in doc["levels"]["none"]
    assert (out / "goodput-sim-errors.png").stat().st_size > 10_000
    for bad in (["--errors", "bogus:1"], ["--engine", "real", "--errors"], ["--errors", "none", "--seeds", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "goodput", *bad])
        assert exit_.value.code == 2


def test_a_noisy_level_reports_the_median_over_seeds(tmp_path: Path) -> None:
    """`--seeds N`: each point of a noisy level is N simulations, reported as their medians; a level
    without noise does not depend on the seed and runs once."""
    from engine.core.config import EngineConfig
    from engine.protocol.slo import DEFAULT_CLASSES
    from engine.sim.errors import PredictionError
    from loadtest.goodput import Runner
    from loadtest.goodput_errors import median_point
    from loadtest.workload import azure_mix, head, scale_to_rate

    out = tmp_path / "out"
    assert main(["bench", "goodput", "--engine", "sim", "--cost", "llama-3.1-8b@h100", "--requests", "200",
                 "--rates", "40", "--policies", "flowprefill", "--errors", "none,noise:1", "--seeds", "3",
                 "--out", str(out)]) == 0
    doc = json.loads((out / "goodput-sim-errors.json").read_text())
    noisy = doc["levels"]["noise:1"]["policies"]["flowprefill"]["points"][0]
    assert noisy["seeds"] == 3 and "seeds" not in doc["levels"]["none"]["policies"]["flowprefill"]["points"][0]
    runner = Runner("sim", EngineConfig(prefix_caching=False), "llama-3.1-8b@h100")
    w = scale_to_rate(head(azure_mix(), 200), 40)
    singles = [runner.sim("flowprefill", w, DEFAULT_CLASSES, 1.0, error=PredictionError.parse("noise:1"), seed=s)
               for s in range(3)]
    assert len({p["attainment"] for p in singles}) > 1  # the seeds draw different noise
    assert noisy["attainment"] == sorted(p["attainment"] for p in singles)[1]
    assert median_point(singles) == noisy


def test_goodput_bench_runs_the_real_engine_on_a_checkpoint(tmp_path: Path, tiny_checkpoint,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            torch_single_thread: None) -> None:
    """--model and the other engine options reach the real engine (how a GPU run measures an 8B
    checkpoint: .ci/gpu-check); with $FLOWPREFILL_BATCH_LOG each policy's engine logs its batches
    apart. A checkpoint that is not there is one line and exit 2, before anything loads."""
    from engine.core import batch_log

    model = tiny_checkpoint("llama")
    trace = tmp_path / "short.csv"  # the tiny model's context is 512 tokens
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:0{i}.000000,{n},1\n" for i, n in enumerate([40, 300, 120, 450, 60, 200])))
    monkeypatch.setenv(batch_log.ENV, str(tmp_path / "batches"))
    out = tmp_path / "out"
    assert main(["bench", "goodput", "--engine", "real", "--model", str(model), "--workload", str(trace),
                 "--kv-capacity-tokens", "8192", "--kv-block-size", "16", "--policies", "flowprefill,chunked:2048",
                 "--rates", "20", "--slo-scales", "", "--no-ideal", "--out", str(out)]) == 0
    doc = json.loads((out / "goodput-real.json").read_text())
    assert doc["workload"]["requests"] == 6
    from engine.core.config import ModelConfig

    assert doc["model"] == ModelConfig.from_dir(model).name
    assert all(len(p["points"]) == 1 for p in doc["policies"].values())
    logs = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "batches").iterdir())
    assert logs == ["batches-chunked2048", "batches-flowprefill"]
    assert all(batch_log.read(tmp_path / "batches"))

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "goodput", "--engine", "real", "--model", str(tmp_path / "missing")])
    assert exit_.value.code == 2


def test_no_baseline_at_90_percent_is_no_ratio() -> None:
    """A level where no baseline kept 90 % at any rate has no ratio (not `inf`, a win even where
    FlowPrefill did not keep it either), and says whether FlowPrefill did."""
    from loadtest.goodput_errors import over_best

    assert over_best(3.0, "fcfs", 1.5) == {"best": "fcfs", "ratio": 2.0}
    assert over_best(0.0, "fcfs", 0.0) == {"best": "fcfs", "ratio": None, "flowprefill_kept_90": False}
    assert over_best(2.4, "fcfs", 0.0)["flowprefill_kept_90"] is True


def test_the_error_table_says_when_there_is_no_ratio() -> None:
    from rich.console import Console

    from loadtest.goodput_errors import over_best, table

    pol = {"max_goodput_rps": 0.0, "max_goodput_per_class_rps": 0.0, "p99_over_target_at_knee": None, "points": []}
    doc = {"workload": {"name": "w", "requests": 1}, "cost_model": "cpu", "levels": {
        "slowdown:5": {"policies": {"flowprefill": pol, "fcfs": pol},
                       "flowprefill/best": over_best(0.0, "fcfs", 0.0),
                       "flowprefill/best, every class": over_best(1.0, "fcfs", 0.0)}}}
    console = Console(record=True, width=200)
    console.print(table(doc))
    text = console.export_text()
    assert "no baseline >= 90 %, nor flowprefill" in text and "│ no baseline >= 90 % │" in text


def test_batches_to_converge() -> None:
    """Batches before the first ten in a row predicted within 10 % (a miss inside the ten restarts it)."""
    from loadtest.goodput_errors import batches_to_converge

    assert batches_to_converge([2.0, 0.01, 2.0] + [0.05] * 10) == 3
    assert batches_to_converge([0.0] * 9 + [0.5] + [0.0] * 10) == 10
    assert batches_to_converge([0.0] * 9) is None
    assert batches_to_converge([-0.1] * 10) == 0


def _flowprefill_on_h200(trace: Path, out: Path, rates: str, *extra: str) -> dict:
    """A FlowPrefill sweep of `trace` on the simulated H200: its goodput-sim.json."""
    assert main(["bench", "goodput", "--engine", "sim", "--cost", "llama-3.1-8b@h200", "--workload", str(trace),
                 "--policies", "flowprefill", "--rates", rates, "--slo-scales", "", "--no-ideal", *extra,
                 "--out", str(out)]) == 0
    return json.loads((out / "goodput-sim.json").read_text())


def test_the_host_time_per_batch_is_a_what_if_of_the_simulator(tmp_path: Path) -> None:
    """--host-ms: the same sweep with the host's time per batch serialized (the H200 model's 3.8 ms) and
    overlapped with the device (0): goodput can only rise when the host stops costing device time."""
    trace = _trace(tmp_path)
    best = {}
    for host in ("3.8", "0"):
        doc = _flowprefill_on_h200(trace, tmp_path / host, "5,20,40,80,160", "--host-ms", host)
        assert "--host-ms " + host in doc["command"]
        best[host] = doc["policies"]["flowprefill"]["points"]
    served = [(sum(p["attainment"] for p in best[h])) for h in ("3.8", "0")]
    assert served[1] >= served[0] and best["0"] != best["3.8"]
    for bad in (["--engine", "real", "--host-ms", "1"], ["--host-ms", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "goodput", *bad])
        assert exit_.value.code == 2


def test_answers_cost_the_simulated_device_its_decode_steps(tmp_path: Path) -> None:
    """--max-tokens: each request answers its trace's 10 tokens, decoded between prefill steps on the
    simulated H200 (a decode step of the 8B model reads its 16 GB of weights): attainment can only fall."""
    trace = _trace(tmp_path)
    served = {}
    for answer in ("1", "10"):
        doc = _flowprefill_on_h200(trace, tmp_path / answer, "20,80,160", "--max-tokens", answer)
        assert doc["max_tokens"] == int(answer)
        served[answer] = [p["attainment"] for p in doc["policies"]["flowprefill"]["points"]]
    assert sum(served["10"]) < sum(served["1"])
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "goodput", "--max-tokens", "0"])
    assert exit_.value.code == 2


def test_requests_answer_what_the_trace_says_at_most_max_tokens() -> None:
    from engine.protocol.slo import DEFAULT_CLASSES
    from loadtest.goodput import make_requests
    from loadtest.workload import TraceRequest, Workload

    w = Workload("w", "test", "given", [TraceRequest(0.0, 100, 5, "standard"), TraceRequest(0.1, 100, 50, "standard"),
                                        TraceRequest(0.2, 100, 0, "standard")])
    assert [r.sampling.max_tokens for r in make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None, 20)] == [5, 20, 1]
    assert [r.sampling.max_tokens for r in make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)] == [1, 1, 1]


def test_a_trace_naming_its_blocks_shares_them_in_both_engines() -> None:
    """mooncake-4k: prompts cut to 4,096 tokens, their blocks' hash ids kept. Real prompts are built block
    by block (the same id, the same tokens: the engine's prefix cache finds them); simulated ones carry
    the ids as block hashes (the simulator's)."""
    from engine.protocol.slo import DEFAULT_CLASSES
    from loadtest.goodput import make_requests
    from loadtest.workload import PREFIX_BLOCK_TOKENS, head, mooncake

    w = head(mooncake(), 100)
    assert max(r.input_tokens for r in w.requests) == 4096
    assert all(len(r.prefix) == -(-r.input_tokens // PREFIX_BLOCK_TOKENS) for r in w.requests)
    real, sim = make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, 512), make_requests(w, DEFAULT_CLASSES, 1.0, 0.0, None)
    pairs = [(a, b) for a in range(len(w.requests)) for b in range(a)
             if w.requests[a].prefix[:1] == w.requests[b].prefix[:1]]
    assert pairs
    for a, b in pairs:
        shared = 0
        while shared < min(len(w.requests[a].prefix), len(w.requests[b].prefix)) and \
                w.requests[a].prefix[shared] == w.requests[b].prefix[shared]:
            shared += 1
        n = min(shared * PREFIX_BLOCK_TOKENS, real[a].num_prompt_tokens, real[b].num_prompt_tokens)
        assert real[a].prompt_token_ids[:n] == real[b].prompt_token_ids[:n]
        assert sim[a].block_hashes[:shared] == sim[b].block_hashes[:shared]
    assert all(r.block_hashes is None for r in real)


def test_the_simulated_twin_caches_a_traces_prefixes(tmp_path: Path) -> None:
    served = {}
    for caching in ("--prefix-caching", "--no-prefix-caching"):
        out = tmp_path / caching
        assert main(["bench", "goodput", "--engine", "sim", "--cost", "llama-3.1-8b@h100", "--workload", "mooncake-4k",
                     "--requests", "300", "--policies", "flowprefill", "--rates", "40,80", "--slo-scales", "",
                     "--no-ideal", caching, "--out", str(out)]) == 0
        doc = json.loads((out / "goodput-sim.json").read_text())
        served[caching] = [p["attainment"] for p in doc["policies"]["flowprefill"]["points"]]
    assert sum(served["--prefix-caching"]) > sum(served["--no-prefix-caching"])
