"""`--cost FILE.json`: a plan (or a simulated goodput sweep) made with the CPU profile stored in an earlier
plan.json or an engine's profile cache file, instead of this machine's cache as it stands now, which
moves as start-ups join it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from processes import in_process
from test_cli import one_line_error

PLAN = ["plan", "--requests", "40", "--threads", "1", "--rate", "6", "--policies", "fcfs,flowprefill",
        "--max-instances", "8", "--pilot", "0", "--engine-pass", "0"]
GOODPUT = ["bench", "goodput", "--engine", "sim", "--threads", "1", "--requests", "40", "--rates", "4",
           "--slo-scales", "", "--policies", "fcfs", "--no-ideal"]


def slowed(entry: dict, factor: float) -> dict:
    """A start-up's measurements as a machine `factor` times slower would have timed them."""
    out = {k: (v * factor if isinstance(v, float) else v) for k, v in entry.items()}
    out["row_block_s"] = {op: [[rows, s * factor] for rows, s in table] for op, table in entry["row_block_s"].items()}
    return out


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], name: str, cost: str) -> dict:
    done = in_process(capsys, *argv, "--cost", cost, "--out", str(tmp_path / name))
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = (tmp_path / name).glob("*.json")
    return json.loads(written.read_text())


def test_a_plan_made_again_from_its_plan_json_plans_with_the_profile_it_had(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path / "cache"))
    first = run(tmp_path, capsys, PLAN, "first", "cpu")
    swept = run(tmp_path, capsys, GOODPUT, "swept", "cpu")
    (cache,) = (tmp_path / "cache").glob("opcost-*.json")
    assert first["cost_profile"]["key"] == cache.stem.removeprefix("opcost-")
    # Start-ups on a machine three times slower join the cache: its median moves with them.
    history = json.loads(cache.read_text())["calibrations"]
    cache.write_text(json.dumps({"calibrations": history + [slowed(history[-1], 3.0)] * 4}))

    stored = str(tmp_path / "first" / "plan.json")
    now = run(tmp_path, capsys, PLAN, "now", "cpu")
    again = run(tmp_path, capsys, PLAN, "again", stored)
    assert now["cost_profile"]["ffn_s_per_row"] == pytest.approx(3 * first["cost_profile"]["ffn_s_per_row"])
    assert now["policies"] != first["policies"]  # the slower profile simulates other outcomes
    assert again["cost_profile"] == first["cost_profile"] and again["policies"] == first["policies"]
    assert again["cost_model"] == stored and "pilot" not in again and "engine_pass" not in again
    assert run(tmp_path, capsys, GOODPUT, "swept-again", stored)["policies"] == swept["policies"]

    # An engine's cache file: the median of its start-ups, here the slowed ones.
    from_cache = run(tmp_path, capsys, PLAN, "from-cache", str(cache))
    assert from_cache["cost_profile"] == now["cost_profile"] and from_cache["policies"] == now["policies"]


def test_a_stored_profile_of_another_engine_or_of_nothing_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path / "cache"))
    doc = run(tmp_path, capsys, PLAN, "first", "cpu")
    stored = str(tmp_path / "first" / "plan.json")

    def refused(*argv: str) -> str:
        return one_line_error(in_process(capsys, *argv))

    line = refused(*PLAN, "--threads", "2", "--cost", stored)  # the last --threads counts
    assert f"--cost {stored}: profiled for " in line and "-t1-" in line and "-t2-" in line and "--threads" in line
    keyless = tmp_path / "keyless.json"  # a plan.json from before plans kept the key: its model's name
    keyless.write_text(json.dumps(doc | {"model": "another-model", "cost_profile": {
        k: v for k, v in doc["cost_profile"].items() if k != "key"}}))
    assert "profiled for the model another-model" in refused(*PLAN, "--cost", str(keyless))
    partial = tmp_path / "partial.json"  # an operator it does not say would cost nothing
    partial.write_text(json.dumps(doc | {"cost_profile": {"ffn_s_per_row": 1e-5, "row_block_s": {}}}))
    assert "no measurement with all of attn_in_s_per_row" in refused(*PLAN, "--cost", str(partial))
    (cache,) = (tmp_path / "cache").glob("opcost-*.json")
    renamed = tmp_path / "profile.json"
    renamed.write_text(cache.read_text())
    assert "keep that name" in refused(*PLAN, "--cost", str(renamed))
    (tmp_path / "no-profile.json").write_text(json.dumps({"policies": {}}))
    assert "neither a plan.json with a cost_profile" in refused(*PLAN, "--cost", str(tmp_path / "no-profile.json"))
    (tmp_path / "broken.json").write_text("{")
    assert "not JSON" in refused(*PLAN, "--cost", str(tmp_path / "broken.json"))
    assert "cannot read it" in refused(*GOODPUT, "--cost", str(tmp_path / "missing.json"))
    assert "cannot read it" in refused(*GOODPUT, "--errors", "none", "--cost", str(tmp_path / "missing.json"))
    assert "--engine real predicts with its own profile" in refused(*GOODPUT, "--engine", "real", "--cost", stored)
    assert "use it with --cost cpu" in refused("bench", "planner", *PLAN[1:], "--cost", stored, "--against-serve", "1")
