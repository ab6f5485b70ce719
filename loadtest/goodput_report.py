"""What `flowprefill bench goodput` prints and plots of a sweep's goodput.json document: the max-goodput
table with its ratios, and attainment against the offered rate and the SLO scale."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest import report

IDEAL = "flowprefill-ideal"  # the simulator's bound: zero stop latency, exact costs (drawn dashed)


def table(console: Console, doc: dict[str, Any]) -> None:
    t = Table(title=f"max goodput ({doc['engine']}, {doc['workload']['name']}, "
                    f"{doc['workload']['requests']} requests, >= 90 % attainment)", caption=report.BELOW_CAPTION)
    for col in ("policy", "max goodput req/s", "every class >= 90 %", "tightest SLO scale"):
        t.add_column(col, justify="right")
    tight = doc["slo_scale_sweep"]["tightest_scale_at_target"]
    for name, pol in doc["policies"].items():
        t.add_row(name, report.goodput_label(pol["max_goodput_rps"], pol["points"]),
                  report.goodput_label(pol["max_goodput_per_class_rps"], pol["points"]),
                  "-" if tight.get(name) is None else f"{tight[name]:g}")
    console.print(t)
    r = Table(title="ratios")
    r.add_column("ratio")
    r.add_column("value", justify="right")
    for k, v in doc["ratios"].items():
        r.add_row(k, report.ratio_label(v))
    console.print(r)
    if doc["engine"] == "real":
        a = Table(title="simulator against the real engine (every measured point, percentage points)")
        for col in ("simulated with", "points", "median |sim - real|", "within 5 pp"):
            a.add_column(col, justify="right")
        for key, label in (("sim_attainment", "the cost model"), ("sim_exact_attainment", "the measured costs")):
            gaps = [abs(pt[key] - pt["attainment"]) * 100 for pol in doc["policies"].values()
                    for pt in pol["points"] if pt.get(key) is not None]
            if gaps:
                a.add_row(label, str(len(gaps)), f"{statistics.median(gaps):.1f}",
                          f"{sum(g <= 5 for g in gaps)} of {len(gaps)}")
        console.print(a)
        g = Table(title="host gap: the engine idle between batches while work waited (ms)")
        for col in ("policy", "rate", "batches", "median", "p99"):
            g.add_column(col, justify="right")
        for name, pol in doc["policies"].items():
            for pt in pol["points"]:
                if gap := pt.get("host_gap_ms"):
                    g.add_row(name, f"{pt['rate']:g}", str(gap["batches"]), f"{gap['p50']:.3f}", f"{gap['p99']:.3f}")
        console.print(g)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = doc["slo_scale_sweep"]
    scaled = any(sweep["policies"].get(name) for name in doc["policies"])
    fig, axes = plt.subplots(1, 2 if scaled else 1, figsize=(12 if scaled else 7, 4.5), squeeze=False)
    a, b = axes[0][0], axes[0][-1]
    for name, pol in doc["policies"].items():
        style = "--" if name == IDEAL else "-"
        pts = pol["points"]
        line, = a.plot([q["rate"] for q in pts], [q["attainment"] * 100 for q in pts], style, marker="o", label=name)
        if any("sim_attainment" in q for q in pts):  # a real run: its simulated twin, from the same cost model
            a.plot([q["rate"] for q in pts], [q["sim_attainment"] * 100 for q in pts], ":", color=line.get_color(),
                   lw=1, label=f"{name}, simulated")
        if scaled:
            sp = sweep["policies"][name]
            b.plot([q["slo_scale"] for q in sp], [q["attainment"] * 100 for q in sp], style, marker="o", label=name)
    panels = [(a, "offered rate (req/s)", "attainment vs rate")]
    if scaled:
        panels.append((b, f"SLO scale (at {sweep['rate']:g} req/s)", "attainment vs SLO scale"))
    for ax, xl, title in panels:
        ax.axhline(90, color="grey", lw=0.8, ls=":")
        ax.set_xlabel(xl)
        ax.set_ylabel("TTFT SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
        ax.set_title(title)
    a.legend(fontsize=8)
    fig.suptitle(f"{doc['workload']['name']} on {doc['model']} ({doc['engine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
