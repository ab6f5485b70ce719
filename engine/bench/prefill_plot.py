"""The PNG of `flowprefill bench prefill`: throughput, checkpoint overhead and stop latency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

UNSPLIT, PREEMPTIBLE, HF = "ours unsplit", "ours preemptible", "transformers"


def size_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("throughput", "overhead", "stop_latency") if k in results]
    if not panels:
        return
    staircase = results["config"].get("calibration", {}).get("row_block_s")
    if staircase:
        panels.append("staircase")
    widths = {"throughput": 1.2, "overhead": 0.7, "stop_latency": 1.4, "staircase": 1.0}
    fig, axes = plt.subplots(1, len(panels), figsize=(max(9.0, 5.2 * sum(widths[p] for p in panels)), 5.0),
                             gridspec_kw={"width_ratios": [widths[p] for p in panels]}, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "staircase":
            _staircase(ax, results["config"]["calibration"])
        else:
            draw = {"throughput": _throughput, "overhead": _overhead, "stop_latency": _stop_latency}[panel]
            draw(ax, results[panel])
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _title(results: dict[str, Any]) -> str:
    m, cfg = results["machine"], results["config"]
    load = m.get("loadavg_at_start")
    model = cfg.get("model", {}).get("name") or "default model"
    where = (f"{m['gpu']['name']} · {cfg['engine_config']['dtype']} · {cfg.get('attention_backend', '')} attention"
             if str(cfg["engine_config"].get("device", "cpu")).startswith("cuda") and m.get("gpu")
             else f"{m['cpu_count']} CPUs ({m['cpu_model']}), {m['torch_threads']} torch threads")
    return (f"FlowPrefill prefill bench · {model}{' · QUICK' if cfg['quick'] else ''}\n"
            f"{where}, torch {m['torch_version']}{f' · load avg {load[0]:.1f}' if load else ''}"
            f" · {results['started_at'][:16]}")


def _throughput(ax: Any, r: dict[str, Any]) -> None:
    """Tokens per second per contender and size: the median's line, each repetition a faint dot."""
    colors = {UNSPLIT: "tab:orange", PREEMPTIBLE: "tab:blue", HF: "tab:gray"}
    for name in r["contenders"]:
        xs = r["sizes"]
        med = [r["tokens_per_s"][name][str(n)] for n in xs]
        ax.plot(xs, med, "o-", color=colors.get(name), label=name, lw=2)
        for n in xs:  # every repetition, faint: the spread the median hides
            reps = [n / t for t in r["raw_s"][name][str(n)]]
            ax.scatter([n] * len(reps), reps, color=colors.get(name), s=12, alpha=0.35, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(r["sizes"], [size_label(n) for n in r["sizes"]])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens / s (line: median; dots: repetitions)")
    ax.set_title("Prefill throughput")
    ax.legend(fontsize=8)


def _overhead(ax: Any, r: dict[str, Any]) -> None:
    """The split's cost per size: the ratio of medians as bars, each interleaved pair as a dot."""
    xs = r["sizes"]
    vals = [r["per_size"][str(n)]["overhead_pct"] for n in xs]
    paired = [r["per_size"][str(n)]["paired_overhead_pct"] for n in xs]
    pos = list(range(len(xs)))
    bars = ax.bar(pos, vals, color=["tab:red" if v > 5 else "tab:blue" for v in vals], width=0.5,
                  label="ratio of medians")
    line = [r["per_size"][str(n)].get("linear_blocks_overhead_pct") for n in xs]
    if all(v is not None for v in line):  # the same split cut by the per-row line (CUDA)
        ax.bar([p - 0.37 for p in pos], line, width=0.2, color="none", edgecolor="tab:gray", hatch="//",
               label="blocks from the line")
    # Keep the bars readable: a wild repetition (a descheduled thread) is drawn at the edge.
    second = [sorted(abs(v) for v in pts)[-2] for pts in paired if len(pts) > 1]
    hi = max(10.0, *(1.4 * abs(v) for v in vals + [v for v in line if v is not None]),
             *(1.2 * v for v in second))
    for p, pts in zip(pos, paired, strict=True):
        inside = [v for v in pts if -hi <= v <= hi]
        ax.scatter([p] * len(inside), inside, color="k", s=10, zorder=3,
                   label="per-repetition pair" if p == 0 else None)
        above, below = sum(v > hi for v in pts), sum(v < -hi for v in pts)
        if above:
            ax.scatter([p], [hi * 0.97], marker="^", color="k", s=25, zorder=3)
            ax.annotate(f"{above} off scale", (p, hi * 0.97), xytext=(6, -3), textcoords="offset points",
                        fontsize=7)
        if below:
            ax.scatter([p], [-hi * 0.97], marker="v", color="k", s=25, zorder=3)
            ax.annotate(f"{below} off scale", (p, -hi * 0.97), xytext=(6, -3), textcoords="offset points",
                        fontsize=7)
    ax.set_ylim(-hi if min(min(vals), *(min(pts) for pts in paired)) < 0 else 0, hi)
    for b, v in zip(bars, vals, strict=True):
        ax.annotate(f"{v:+.1f}%", (b.get_x() + b.get_width(), v), xytext=(4, 0), textcoords="offset points",
                    ha="left", va="center", fontsize=9, fontweight="bold")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(pos, [size_label(n) for n in xs])
    ax.set_xlim(-0.75, len(xs) - 0.25)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("preemptible vs checkpoints off (% slower)")
    ax.set_title(f"Checkpoint overhead ({r['step_budget_ms']:g} ms steps)")
    ax.legend(fontsize=8)


def _stop_latency(ax: Any, r: dict[str, Any]) -> None:
    """Stop latency per prompt length, with and without the split: every sample, p50 and p99."""
    xs = r["sizes"]
    styles = {"split": ("tab:blue", "with split"), "unsplit": ("tab:orange", "without split")}
    for mode, per in r["modes"].items():
        color, name = styles[mode]
        have = [n for n in xs if per[str(n)]["n"]]
        for n in have:
            ms = per[str(n)]["samples_ms"]
            jitter = np.exp(np.random.default_rng(n).uniform(-0.06, 0.06, len(ms)))
            ax.scatter(np.asarray([n] * len(ms)) * jitter, np.maximum(ms, 1e-3), color=color, s=10,
                       alpha=0.35, lw=0)
        ax.plot(have, [per[str(n)]["p50_ms"] for n in have], "o-", color=color, lw=2, label=f"{name} p50")
        ax.plot(have, [per[str(n)]["p99_ms"] for n in have], "s--", color=color, lw=1.5,
                label=f"{name} p99")
    ax.axhline(r["target_ms"], color="tab:red", ls=":", lw=1.5, label=f"{r['target_ms']:g} ms target")
    budget = r["modes"].get("split", {}).get("budget_s")
    if budget:
        ax.axhline(budget * 1e3, color="tab:blue", ls=":", lw=1, alpha=0.6,
                   label=f"{budget * 1e3:g} ms step budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [size_label(n) for n in xs])
    ax.set_xlabel("prompt tokens of the preempted prefill")
    ax.set_ylabel("stop latency (ms, log)")
    ax.set_title("Preemption stop latency (engine, flowprefill)")
    ax.legend(fontsize=8, loc="upper left")


def _staircase(ax: Any, calibration: dict[str, Any]) -> None:
    """Measured time of one row-wise step against its rows (CUDA calibration) and the per-row line."""
    colors = {"attn_in": "tab:green", "ffn": "tab:purple"}
    for op, table in calibration["row_block_s"].items():
        rows = [n for n, _ in table]
        ax.step(rows, [s * 1e3 for _, s in table], where="pre", color=colors.get(op), lw=1.5,
                label=f"{op} measured")
        per_row = calibration[f"{op}_s_per_row"]
        ax.plot([0, rows[-1]], [0, rows[-1] * per_row * 1e3], ls=":", color=colors.get(op), lw=1,
                label=f"{op} line")
    ax.set_xlabel("rows in one step")
    ax.set_ylabel("ms per step")
    ax.set_title("Row-block staircase (what the split cuts by)")
    ax.legend(fontsize=8)
