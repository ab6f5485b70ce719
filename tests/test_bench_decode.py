"""`flowprefill bench decode` (engine/bench/decode.py): it runs, its backends answer alike, and a mistake is
one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.attention import cpu
from engine.bench import decode


def test_the_benchmark_runs_and_reports(tmp_path: Path) -> None:
    if cpu.unsupported(torch.float32, 32):
        pytest.skip(f"the CPU attention kernel {cpu.unsupported(torch.float32, 32)}")
    threads = torch.get_num_threads()
    try:
        assert decode.main(["--answers", "1,3", "--contexts", "20,70", "--repeats", "1", "--threads", "1",
                            "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "decode.json").read_text())
    assert set(results["cells"]) == {"1x20", "1x70", "3x20", "3x70"}
    for cell in results["cells"].values():
        assert set(cell["median_ms"]) == {"cpu", "sdpa"} and min(cell["median_ms"].values()) > 0
        assert cell["max_relative_difference"] < 1e-4  # the paged kernel's logits are the gathered SDPA's
    assert (tmp_path / "decode.png").stat().st_size > 10_000


def test_a_wrong_result_or_argument_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    cell = {"max_relative_difference": 0.2}
    assert not decode.agree({"config": {"dtype": "float32"}, "cells": {"1x8": cell}})
    with pytest.raises(SystemExit) as exit_:
        decode.main(["--backends", "cpu,gpu"])
    assert exit_.value.code == 2 and "distinct names of cpu, sdpa, flashinfer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        decode.main(["--repeats", "0"])
    assert exit_.value.code == 2 and "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        decode.main(["--backends", "flashinfer", "--answers", "1", "--contexts", "8"])
    assert exit_.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
