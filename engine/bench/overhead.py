"""Section 2 of `flowprefill bench prefill`: what the checkpoints cost.

The preemptible forward (the split at the step budget + the engine's per-step "still chosen?"
check) against the same forward with checkpoints off, interleaved, in percent. Where the cost model
has a measured row-block staircase (CUDA), a third contender sizes its token blocks from the per-row
rate instead, so one run shows what wave-filling blocks buy.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine.bench.contenders import OurPrefill, device_sync, interleaved
from engine.bench.prefill_plot import size_label
from engine.bench.stop_latency import random_prompt
from engine.core.config import EngineConfig
from engine.core.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model.cost import OpCost

LINEAR = "preemptible, blocks from a line"  # the split sized by the per-row rate, not the staircase


def median(xs: Sequence[float]) -> float:
    """NaN for no samples: a statistic of nothing, not a crash in the middle of a bench."""
    return statistics.median(xs) if xs else float("nan")


def _paired_pct(on: Sequence[float], off: Sequence[float]) -> list[float]:
    """Each round's preemptible run over its checkpoints-off run, in percent slower."""
    return [100 * (a / b - 1) for a, b in zip(on, off, strict=True)]


class OverheadSection:
    """Mixed into the prefill benchmark, which provides these attributes."""

    console: Console
    progress: Progress
    plan: Any
    cfg: EngineConfig
    gen: torch.Generator
    budget_s: float

    model: Callable[[], tuple[LlamaModel, OpCost, KVCache]]

    def overhead(self) -> dict[str, Any]:
        model, cost, kv = self.model()
        runs = {"preemptible": OurPrefill(model, kv, cost, self.budget_s, check=True),
                "off": OurPrefill(model, kv, cost, None, check=False)}
        if cost.row_block_s:  # what sizing token blocks from the measured staircase buys (CUDA)
            runs[LINEAR] = OurPrefill(model, kv, replace(cost, row_block_s={}), self.budget_s, check=True)
        sizes = self.plan.overhead_sizes
        task = self.progress.add_task("overhead", total=len(sizes) * (self.plan.repeats + 1) * len(runs))
        out: dict[str, Any] = {"sizes": list(sizes), "step_budget_ms": self.cfg.step_budget_ms, "per_size": {}}
        for n in sizes:
            self.progress.update(task, description=f"overhead {size_label(n)}")
            ids = random_prompt(n, model.cfg.vocab_size, self.gen)
            table = kv.allocate(n)
            try:
                cpu: dict[str, list[float]] = {}
                times = interleaved({name: lambda run=run, ids=ids, table=table: run(ids, table)
                                     for name, run in runs.items()},
                                    self.plan.repeats, lambda: self.progress.advance(task),
                                    device_sync(self.cfg.device), cpu)
            finally:
                kv.free(table)
            m_on, m_off = median(times["preemptible"]), median(times["off"])
            paired = _paired_pct(times["preemptible"], times["off"])
            out["per_size"][str(n)] = per = {
                "preemptible_s": times["preemptible"], "off_s": times["off"],
                "median_preemptible_s": m_on, "median_off_s": m_off,
                "overhead_pct": 100 * (m_on / m_off - 1),
                "paired_overhead_pct": paired, "median_paired_overhead_pct": median(paired),
                "steps_preemptible": runs["preemptible"].last_steps, "steps_off": runs["off"].last_steps,
                "mean_step_ms_preemptible": m_on / runs["preemptible"].last_steps * 1e3,
            }
            if self.cfg.device == "cpu":  # a shared machine's other processes take wall time, not CPU time
                per.update(preemptible_cpu_s=cpu["preemptible"], off_cpu_s=cpu["off"],
                           cpu_overhead_pct=100 * (median(cpu["preemptible"]) / median(cpu["off"]) - 1),
                           median_paired_cpu_overhead_pct=median(_paired_pct(cpu["preemptible"], cpu["off"])))
            if LINEAR in times:
                per.update(linear_blocks_s=times[LINEAR], steps_linear_blocks=runs[LINEAR].last_steps,
                           linear_blocks_overhead_pct=100 * (median(times[LINEAR]) / m_off - 1))
        self.progress.update(task, description="overhead")
        self._overhead_table(out)
        return out

    def _overhead_table(self, r: dict[str, Any]) -> None:
        t = Table(title=f"2 · Checkpoint overhead: split ({r['step_budget_ms']:g} ms budget) + per-step check "
                  f"vs checkpoints off (median of {self.plan.repeats})", title_justify="left")
        linear = any("linear_blocks_s" in p for p in r["per_size"].values())
        on_cpu = any("cpu_overhead_pct" in p for p in r["per_size"].values())
        for col in ("prompt", "steps on / off", "off ms", "preemptible ms", "slower (medians)", "slower (paired)",
                    *(["CPU time: medians, paired"] if on_cpu else []),
                    *(["blocks from a line: steps, slower"] if linear else [])):
            t.add_column(col, justify="right")
        for n in r["sizes"]:
            p = r["per_size"][str(n)]
            pct = p["overhead_pct"]
            row = [size_label(n), f"{p['steps_preemptible']} / {p['steps_off']}", f"{p['median_off_s'] * 1e3:,.1f}",
                   f"{p['median_preemptible_s'] * 1e3:,.1f}",
                   f"[{'green' if pct <= 5 else 'red'}]{pct:+.1f}%[/]", f"{p['median_paired_overhead_pct']:+.1f}%"]
            if on_cpu:
                row.append(f"{p['cpu_overhead_pct']:+.1f}%, {p['median_paired_cpu_overhead_pct']:+.1f}%")
            if linear:
                row.append(f"{p['steps_linear_blocks']}, {p['linear_blocks_overhead_pct']:+.1f}%")
            t.add_row(*row)
        self.console.print(t)
