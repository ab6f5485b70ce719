"""`flowprefill plan`'s printed tables and its plot (attainment vs instances, per policy). The comparison
with real fleets, `flowprefill bench planner`'s, is engine/bench/planner_validation/report.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def _classes(doc: dict[str, Any]) -> list[str]:
    return sorted({c for pol in doc["policies"].values() for pt in pol["points"] if not pt["stopped_early"]
                   for c in pt["per_class"]})


def print_tables(console: Console, doc: dict[str, Any]) -> None:
    w = doc["workload"]
    goal = "every class" if doc["every_class"] else "overall"
    t = Table(title=f"instances for {doc['target'] * 100:g} % TTFT attainment ({goal}): {w['name']}, "
                    f"{w['requests']} requests at {w['rate']:.2f} req/s, {doc['model']}"
                    + (f", {doc['headroom']:.0%} headroom" if doc.get("headroom") else ""))
    classes = _classes(doc)
    for col in ("policy", "instances", "attainment", *classes, "goodput req/s", "USD / M requests"):
        t.add_column(col, justify="right")
    for name, pol in doc["policies"].items():
        pt, n = pol["at_instances"], pol["instances"]
        if n is None:
            t.add_row(name, f"> {doc['max_instances']}", *["-"] * (len(classes) + 3))
            continue
        cost = pol["cost_per_million_requests"]
        t.add_row(name, str(n), pct(pt["attainment"]),
                  *[pct(pt["per_class"][c]["attainment"]) if c in pt["per_class"] else "-" for c in classes],
                  f"{pt['goodput_rps']:.2f}", "-" if cost is None else f"{cost:,.2f}")
    console.print(t)
    for pol, k in doc["instances_saved_by_flowprefill"].items():
        console.print(f"FlowPrefill needs {abs(k)} instance(s) {'fewer' if k >= 0 else 'more'} than {pol}")
    console.print(f"planned in {doc['planning_s']:.1f} s ({doc['fleets_simulated']} fleets simulated)")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (name, pol) in enumerate(doc["policies"].items()):
        full = [p for p in pol["points"] if not p["stopped_early"]]
        cut = [p for p in pol["points"] if p["stopped_early"]]
        key = "attainment"
        if doc["every_class"]:
            ys = [min(c["attainment"] for c in p["per_class"].values()) * 100 for p in full]
        else:
            ys = [p[key] * 100 for p in full]
        ax.plot([p["instances"] for p in full], ys, marker="o", color=f"C{i}", label=name)
        if cut:  # stopped early: what it could have reached at most
            ax.scatter([p["instances"] for p in cut], [p["attainment_at_most"] * 100 for p in cut], marker="v",
                       color=f"C{i}")
        if pol["instances"] is not None:
            ax.axvline(pol["instances"], color=f"C{i}", lw=0.8, ls=":")
    ax.axhline(doc["target"] * 100, color="grey", lw=0.8, ls="--", label="target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("instances (log 2); dotted: the smallest that meets the target")
    ax.set_ylabel(("lowest class's" if doc["every_class"] else "overall") + " TTFT attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    w = doc["workload"]
    ax.set_title(f"{w['name']}, {w['rate']:.2f} req/s on {doc['model']} (simulated; v: stopped early, at most)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
