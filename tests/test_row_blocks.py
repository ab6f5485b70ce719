"""Token blocks sized from a measured staircase (`OpCost.row_block_s`, CUDA calibration).

A GPU runs a matmul in whole waves of output tiles, so a row-wise step's time is a staircase in its
rows. The planner must then choose, among the block sizes that fit the step budget, the one whose
blocks add up to the least time, and the result must stay that of the unsplit forward.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from test_preemption import CFG, COST, FP32, logits_of, make_weights

from engine.attention.sdpa import SDPABackend
from engine.core.config import ModelConfig
from engine.model.calibration import calibrate, load_cost
from engine.model.cost import ATTN_IN, FFN, OpCost, SeqSpan
from engine.model.llama import LlamaModel
from engine.model.plan import plan_prefill

WAVE_S = 0.5e-3


def waves(rows: int) -> int:
    """An H200-like down projection: 128-row x 256-column tiles, 16 per row of tiles, 132 SMs."""
    return math.ceil(math.ceil(rows / 128) * 16 / 132)


def staircase(cfg: ModelConfig) -> OpCost:
    table = [(rows, waves(rows) * WAVE_S) for rows in range(128, 4097, 128)]
    per_row = table[-1][1] / table[-1][0]
    return OpCost(cfg, attn_in_s_per_row=per_row, ffn_s_per_row=per_row, attn_s_per_pair=1e-12,
                  step_overhead_s=10e-6, row_block_s={ATTN_IN: table, FFN: table})


def ffn_blocks(cost: OpCost, rows: int, budget: float) -> list[int]:
    steps = plan_prefill(cost, [SeqSpan(0, rows)], budget)
    return [s.rows[1] - s.rows[0] for s in steps if s.op == FFN and s.layer == 0]


def ffn_blocks_of(cost: OpCost, spans: list[SeqSpan], budget: float = 5e-5) -> list[int]:
    return [s.rows[1] - s.rows[0] for s in plan_prefill(cost, spans, budget) if s.op == FFN and s.layer == 0]


def test_blocks_fill_whole_waves_instead_of_fitting_a_line() -> None:
    cfg = ModelConfig()
    stairs, budget = staircase(cfg), 1.95e-3
    line = replace(stairs, row_block_s={})
    # The line fits 3,968 rows per step, so 8,192 rows take three steps, of even size there (a
    # CPU's rows cost the same whatever the block): 2,736 rows, 21.4 tile rows run as 22, 2.67 waves
    # run as 3, three times: 9 waves. Blocks of 3,072 rows (24 tile rows, 2.91 waves run as 3) take
    # 3 + 3 + 2 = 8 waves for the same 8,192 rows. Predictions stay the line's.
    assert ffn_blocks(line, 8192, budget) == [2736, 2736, 2720]
    assert ffn_blocks(stairs, 8192, budget) == [3072, 3072, 2048]
    assert sum(waves(n) for n in (3072, 3072, 2048)) < sum(waves(n) for n in (2736, 2736, 2720))

    # What fits in one step stays one step; the least total wins over the fewest steps.
    assert ffn_blocks(stairs, 3000, budget) == [3000]
    assert ffn_blocks(stairs, 4100, budget) == [3072, 1028]  # 3 + 2 waves; 2,048-row blocks: 2 + 2 + 1, 3 steps
    # A block the line fits but the staircase measures over the budget is not chosen, even where it
    # would save a step: 3,100 rows are 25 tile rows, 4 waves (2 ms).
    assert ffn_blocks(line, 3100, budget) == [3100]
    assert ffn_blocks(stairs, 3100, budget) == [3072, 28]
    for rows in (3100, 4100, 6000, 8192, 12_000):
        assert all(waves(n) * WAVE_S <= budget for n in ffn_blocks(stairs, rows, budget)), rows
    # A budget beyond the measured blocks falls back to the line past the table's end.
    assert ffn_blocks(stairs, 20000, 10e-3)[0] > 4096


def test_staircase_split_equals_unsplit() -> None:
    model = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    table = [(rows, math.ceil(rows / 24) * 1e-5) for rows in range(8, 129, 8)]  # waves of 24 rows
    cost = replace(COST, row_block_s={ATTN_IN: table, FFN: table})
    spec = [(300, 0, 300), (47, 0, 47), (250, 130, 120), (1, 0, 1)]
    spans = [SeqSpan(s, n) for _, s, n in spec]
    # 468 rows: the line fits 32-row blocks (2 waves each); the staircase cuts whole waves of 24.
    assert ffn_blocks_of(COST, spans) == [32] * 14 + [20]
    assert ffn_blocks_of(cost, spans) == [24] * 19 + [12]
    torch.testing.assert_close(logits_of(model, spec, 5e-5, cost), logits_of(model, spec, None, cost), **FP32)


def test_calibration_times_the_staircase_and_the_profile_is_the_recent_median(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path))
    model = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    cost = calibrate(model, block_rows=(64, 32, 96))
    for op in (ATTN_IN, FFN):
        assert [rows for rows, _ in cost.row_block_s[op]] == [32, 64, 96]
        assert all(s > 0 for _, s in cost.row_block_s[op])
    assert cost.ffn_s_per_row == cost.row_block_s[FFN][-1][1] / 96
    assert calibrate(model).row_block_s == {}, "a CPU times no staircase unless asked"

    # load_cost's profile is the median of the last HISTORY start-ups, entry by entry of the staircase.
    from engine.model import calibration

    monkeypatch.setattr(calibration, "calibrate", lambda m: replace(cost, row_block_s=dict(cost.row_block_s)))
    first = load_cost(model)
    (path,) = tmp_path.glob("opcost-*.json")
    lucky = json.loads(path.read_text())["calibrations"][-1]
    lucky["row_block_s"][FFN][1][1] = 1e-9
    path.write_text(json.dumps({"calibrations": [lucky, lucky]}))
    again = load_cost(model)  # two lucky start-ups and this one: the lucky time is the median
    assert again.row_block_s[FFN][1] == (64, 1e-9)
    assert again.row_block_s[FFN][0] == first.row_block_s[FFN][0]
    for _ in range(calibration.HISTORY):
        later = load_cost(model)
    assert later.row_block_s == cost.row_block_s, "a lucky start-up stops counting once it is not recent"
    path.write_text(json.dumps({"calibrations": [{**lucky, "row_block_s": "garbage"}]}))
    assert load_cost(model).row_block_s == cost.row_block_s, "an unreadable cache leaves the fresh measurement"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_cpu_calibration_times_the_fixed_cost_of_a_step_on_the_prefills_own_steps(tmp_path, monkeypatch) -> None:
    """The step loop's cost and a row-wise step's weight read are measured, not assumed (a fixed 20 us
    had been, and a 16-token prefill ran 3.7x its prediction); the profile cache's recent start-ups
    are its median, and a profile of an older calibration (no step costs in it) is not merged."""
    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path))
    # Widths whose weights take a row-wise step visibly longer than a one-pair attention step (with
    # CFG's 64 x 128 the two were within the timer's noise, and the floor read 0 in 2 runs of 8).
    wide = replace(CFG, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=64)
    model = LlamaModel(wide, make_weights(wide), SDPABackend())
    cost = calibrate(model)
    assert cost.step_overhead_s > 0 and cost.step_overhead_s != OpCost.step_overhead_s
    assert cost.row_step_floor_s > 0, "a row-wise step reads its weights, which a one-pair attention step does not"
    from engine.model import calibration

    monkeypatch.setattr(calibration, "calibrate", lambda m: replace(cost))
    load_cost(model)
    (path,) = tmp_path.glob("opcost-*.json")
    assert f"-v{calibration.PROFILE_VERSION}" in path.name
    entry = json.loads(path.read_text())["calibrations"][-1]
    path.write_text(json.dumps({"calibrations": [{**entry, "step_overhead_s": 1e-9}] * 2}))
    assert load_cost(model).step_overhead_s == 1e-9
    path.write_text(json.dumps({"calibrations": [{**entry, "step_overhead_s": 1e-9}]}))
    mid = load_cost(model).step_overhead_s  # one cached and this start-up: halfway
    assert mid == pytest.approx((1e-9 + cost.step_overhead_s) / 2)
    del entry["step_overhead_s"]  # profiles without it: the fresh measurement
    path.write_text(json.dumps({"calibrations": [entry] * 4}))
    assert load_cost(model).step_overhead_s == cost.step_overhead_s


def test_a_simulator_reads_the_profile_without_adding_to_it(tmp_path, monkeypatch) -> None:
    """`load_cost(record=False)` (the simulators' probe): the median of the cached start-ups, measuring
    nothing, so that two simulations in a row see the same profile; with nothing cached it measures and
    records as a start-up does."""
    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path))
    model = LlamaModel(CFG, make_weights(CFG), SDPABackend())
    from engine.model import calibration

    base = calibrate(model)
    scales = iter([1.0, 1.4, 0.9, 1.2, 3.0])

    def start_up(_model: LlamaModel) -> OpCost:  # every operator k x the base calibration
        k = next(scales)
        return replace(base, **{name: getattr(base, name) * k for name in calibration._MEASURED})

    monkeypatch.setattr(calibration, "calibrate", start_up)
    first = load_cost(model, record=False)  # nothing cached: measured (x1) and recorded
    (path,) = tmp_path.glob("opcost-*.json")
    assert first.ffn_s_per_row == base.ffn_s_per_row
    for _ in range(3):
        load_cost(model)  # engines' start-ups: x1.4, x0.9, x1.2
    cached = path.read_text()
    sims = [load_cost(model, record=False) for _ in range(2)]
    assert sims[0] == sims[1] and path.read_text() == cached
    assert sims[0].ffn_s_per_row == pytest.approx(base.ffn_s_per_row * 1.1)  # the median of 1, 1.4, 0.9, 1.2
    assert load_cost(model).ffn_s_per_row == pytest.approx(base.ffn_s_per_row * 1.2)  # a start-up at x3 counts


def test_an_engine_told_not_to_calibrate_predicts_with_the_cached_profile(tmp_path, monkeypatch) -> None:
    """`--no-calibrate` (EngineConfig.calibrate): the worker adds no start-up to the profile and predicts
    with the cached one as it stands, as the planner reading it does (`bench planner`'s workers)."""
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine

    monkeypatch.setenv("FLOWPREFILL_CACHE", str(tmp_path))
    Engine(EngineConfig(num_threads=1), policy="fcfs")  # a start-up: calibrated and recorded
    (path,) = tmp_path.glob("opcost-*.json")
    cached = path.read_text()
    pinned = Engine(EngineConfig(num_threads=1, calibrate=False), policy="fcfs")
    assert path.read_text() == cached and len(json.loads(cached)["calibrations"]) == 1
    assert pinned.cost == Engine(EngineConfig(num_threads=1), policy="fcfs", record_profile=False).cost
    Engine(EngineConfig(num_threads=1), policy="fcfs")
    assert len(json.loads(path.read_text())["calibrations"]) == 2


def test_on_the_line_blocks_are_even() -> None:
    """Without a staircase (a CPU) a row-wise op is cut into as many blocks as the budget needs, of
    even size: 512 rows of the FFN as 320 + 192 ran 5 % slower than as 256 + 256 on one AVX-512 core
    (docs/benchmarks.md, the split's overhead), and the largest block sets the stop latency."""
    line = replace(staircase(ModelConfig()), row_block_s={})
    fits_320 = 320 * line.ffn_s_per_row + line.step_overhead_s
    assert ffn_blocks(line, 512, fits_320) == [256, 256]
    assert ffn_blocks(line, 1000, fits_320) == [256, 256, 256, 232]  # rounded up to 8 rows
    assert ffn_blocks(line, 320, fits_320) == [320] and ffn_blocks(line, 100, fits_320) == [100]
