"""`flowprefill bench goodput` end to end on the simulator: SPEC's goodput.json schema, a PNG."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gateway.cli import main


def test_goodput_bench_writes_spec_schema(tmp_path: Path) -> None:
    rng = random.Random(0)
    trace = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(60):  # an Azure-format fixture: a mix of short and long prompts over 30 s
        n = rng.choice([rng.randint(50, 1000), rng.randint(1500, 2000), rng.randint(3000, 9000)])
        rows.append(f"2023-11-16 18:15:{i // 2:02d}.{(i % 2) * 5}000000,{n},10")
    trace.write_text("\n".join(rows) + "\n")
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
    assert (out / "goodput-sim-errors.png").stat().st_size > 10_000
    for bad in (["--errors", "bogus:1"], ["--engine", "real", "--errors"]):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "goodput", *bad])
        assert exit_.value.code == 2
