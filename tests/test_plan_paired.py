"""`bench planner --interleave-pilots`: each real run predicted from the pilot of its own round
(engine/bench/planner_validation/paired.py), and the verdict on the median of those gaps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from test_sim import COST

from engine.core.batch_log import MeasuredBatch
from engine.planner.measured import Planned


class SpeedPlanner:
    """A fleet whose attainment is 1 / the speed factor it is planned at (for 100-token batches): enough to
    see which pilot each round was predicted from."""

    def __init__(self) -> None:
        self.planned: Planned | None = None

    def use(self, planned: Planned) -> None:
        self.planned = planned

    def evaluate(self, policy: str, n: int, stop_early: bool = True) -> dict[str, Any]:
        assert self.planned is not None and not stop_early
        x = 1 / self.planned.cost.factor(100)
        return {"attainment": x, "per_class": {"interactive": {"attainment": x}, "standard": {"attainment": 1.0}}}


def pilot_at(factor: float) -> tuple[list[MeasuredBatch], dict[str, Any]]:
    return [MeasuredBatch([f"p{i}"], 0.01, 0.01 * factor, 1.0, 100, began_at=float(i), finished_at=i + 0.01)
            for i in range(12)], {"sent": 12, "attainment": 1.0, "failed": 0, "logs": "-"}


def point(overall: float, interactive: float) -> dict[str, Any]:
    return {"attainment": overall, "per_class": {"interactive": {"n": 120, "attainment": interactive},
                                                 "standard": {"n": 80, "attainment": 1.0}}}


def test_each_run_is_predicted_from_its_own_round_s_pilot_and_judged_on_the_median_gap() -> None:
    """Three rounds: pilots at 2x, 4x and 1x; runs at 0.5, 0.3 and 0.4. Round 3's machine sped up for the
    pilot alone (predicted 1.0, ran 0.4): one outlier among the gaps 0, -0.05, +0.6, whose median is 0.
    The median of the predictions (0.5) against the runs' median (0.4) would read +0.1."""
    from engine.bench.planner_validation.paired import paired

    pairs = [(1, pilot_at(2.0), point(0.5, 0.5)), (2, pilot_at(4.0), point(0.3, 0.3)),
             (3, pilot_at(1.0), point(0.4, 0.4))]
    out = paired(SpeedPlanner(), "fcfs", 1, COST, pairs)  # type: ignore[arg-type]
    assert out is not None
    assert [r["round"] for r in out["rounds"]] == [1, 2, 3]
    assert [r["attainment"] for r in out["rounds"]] == pytest.approx([0.5, 0.25, 1.0], rel=0.02)
    assert out["attainment"] == pytest.approx(0.5, rel=0.02) and out["median_gap"] == pytest.approx(0.0, abs=0.01)
    lo, hi = out["gap_interval"]
    assert lo <= out["median_gap"] <= hi
    assert out["per_class"]["interactive"]["median_gap"] == pytest.approx(0.0, abs=0.01)
    assert out["per_class"]["standard"] == {"attainment": 1.0, "median_gap": 0.0, "gap_interval": [0.0, 0.0]}
    assert paired(SpeedPlanner(), "fcfs", 1, COST, []) is None  # type: ignore[arg-type]


def test_a_round_pairs_a_fleet_s_run_with_its_own_shape_s_pilot_of_that_round_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--against-serve 1,2 --repeats 3` with pilots: each real fleet's run is paired with the pilot of its
    own number of workers that ran just before it, in the same round; a round whose pilot failed, or whose
    run did not start, pairs nothing (its other rounds still do)."""
    from engine.bench.planner_validation.against_serve import real_rounds
    from engine.bench.planner_validation.command import build_parser
    from engine.planner import serve_runs
    from engine.planner.speed import PilotError
    from loadtest.workload import azure_mix, head

    def fake_real_point(policy, n, threads, w, schedule, logs):  # type: ignore[no-untyped-def]
        if (n, logs.name) == (2, "run-3"):
            raise RuntimeError("serve exited 2: address already in use")
        return point(0.1 * n + 0.01 * int(logs.name[-1]), 0.5), ["http://w0"], []

    def fake_pilot(policy: str, n: int, r: int) -> Any:
        if (n, r) == (1, 1):  # round 2's one-worker pilot
            raise PilotError("pilot: serve exited 2")
        return pilot_at(float(10 * n + r))

    monkeypatch.setattr(serve_runs, "real_point", fake_real_point)
    args = build_parser().parse_args(["--requests", "6", "--rate", "2", "--against-serve", "1,2", "--repeats", "3",
                                      "--policies", "fcfs", "--out", str(tmp_path)])
    rounds = real_rounds(args, head(azure_mix(), 6), ["fcfs"], Console(quiet=True), fake_pilot,
                         [("fcfs", 1), ("fcfs", 2)])
    def said(fleet: tuple[str, int]) -> list[tuple[int, float, float]]:  # round, pilot's factor, run's attainment
        return [(r, round(pilot[0][0].exec_s / 0.01, 6), round(run["attainment"], 6))
                for r, pilot, run in rounds.pairs[fleet]]

    assert said(("fcfs", 1)) == [(1, 10.0, 0.11), (3, 12.0, 0.13)]
    assert said(("fcfs", 2)) == [(1, 20.0, 0.21), (2, 21.0, 0.22)]


def test_the_verdict_on_paired_gaps_counts_their_median_and_tells_a_miss_by_their_interval() -> None:
    """For the paired simulation a cell's gap is the median of the rounds' own gaps (not its median
    prediction less the runs' median), and a miss is beyond the band when that gap's interval is; the
    table shows it as its own column."""
    from engine.bench.planner_validation.report import against_table, agreement, print_agreement

    def each(gap: float, interval: list[float]) -> dict[str, Any]:
        cell = {"attainment": 0.9, "median_gap": gap, "gap_interval": interval}
        rounds = [{"attainment": x, "real": 0.5, "per_class": {c: {"attainment": x, "real": 0.5}
                                                              for c in ("interactive", "standard")}}
                  for x in (0.52, 0.9, 0.46)]  # within 5, not, within (on the band's edge: 4 points)
        return cell | {"per_class": {"interactive": dict(cell), "standard": dict(cell)}, "rounds": rounds}

    rows = [{"policy": "fcfs", "workers": 1, "real": point(0.5, 0.5), "sim": point(0.5, 0.5),
             "sim_paired": each(0.03, [-0.01, 0.06])},  # 0.9 vs the runs' 0.5: +40 as a median, +3 paired
            {"policy": "fcfs", "workers": 2, "real": point(0.5, 0.5), "sim": point(0.5, 0.5),
             "sim_paired": each(-0.08, [-0.12, -0.06])}]
    summary = agreement(rows)["sim_paired"]
    assert (summary["cells"], summary["within"], summary["beyond_interval"]) == (6, 3, 3)
    assert summary["largest_gap"]["points"] == pytest.approx(-8.0) and summary["largest_gap"]["workers"] == 2
    rows[1]["sim_paired"] = each(-0.08, [-0.2, 0.0])  # rounds that scatter: the miss is not told
    assert agreement(rows)["sim_paired"]["beyond_interval"] == 0
    console = Console(record=True, width=400)
    against_table(console, rows)
    print_agreement(console, agreement(rows))
    text = console.export_text()
    assert "each run at its pilot: runs within 5" in text and "+3.0" in text and "+40.0" not in text
    assert "2 of 3" in text  # the rounds' runs their own pilot predicted within 5 points
    assert "each run at the pilot before it (median gap over rounds): 3 of 6 cells; largest gap -8.0" in text


def test_the_rounds_plot_is_drawn_only_where_runs_were_paired(tmp_path: Path) -> None:
    from engine.bench.planner_validation.report import plot_paired

    doc: dict[str, Any] = {"workload": {"name": "azure-mix", "rate": 5.5},
                           "against_serve": [{"policy": "fcfs", "workers": 1, "real": point(0.5, 0.5)}]}
    assert not plot_paired(doc, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
    rounds = [{"round": r, "attainment": 0.4 + 0.1 * r, "real": 0.5, "per_class": {}} for r in (1, 2, 3)]
    doc["against_serve"][0]["sim_paired"] = {"median_gap": 0.1, "rounds": rounds}
    assert plot_paired(doc, tmp_path / "rounds.png") and (tmp_path / "rounds.png").stat().st_size > 5_000

