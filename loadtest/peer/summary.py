"""What a peer sweep measured, as the goodput.json of docs/reference.md (engine "http", one "policy" per contender) plus
the peer comparison: the ratios the project's targets are stated in, whether each is met, a table
and a plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.table import Table

from engine.protocol.slo import DEFAULT_CLASSES
from loadtest import report
from loadtest.peer.servers import Contender

# FlowPrefill's max goodput / the peer's best configuration, by scenario; the gateway in front of the
# peer / the peer alone; every-class max goodput / the peer's best (docs/benchmarks.md, "Next to vLLM").
TARGETS = {"quiet": 2.0, "contended": 1.0, "step": 1.0, "hogs": 1.0}
GATEWAY_TARGET = 1.2
EVERY_CLASS_TARGET = 1.5
P99_TARGET_FACTOR = 2.0  # contended: interactive p99 TTFT <= this x its target where attainment >= 90 %
# Every scenario: no class's p99 TTFT beyond this x its target at the rate where overall attainment is
# 90 % (the highest rate swept that kept it): overall goodput must not be bought by starving a class
# (leading vLLM 3x overall on long prompts while `batch` waits 29-43 s past its target is no win).
TAIL_TARGET_FACTOR = 3.0
# hogs: at every rate swept, not only where 90 % holds (under hogs there may be none), ours
# keeps interactive p99 TTFT within this x its target and at least the best peer's overall attainment.
HOGS_P99_FACTOR = 4.0
HOGS_ATTAINMENT_RATIO = 1.0


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def _best(policies: dict[str, Any], names: list[str], key: str) -> str | None:
    """The highest `key`; among equals (all 0: none kept 90 % anywhere) the most goodput summed over rates."""
    return max(names, key=lambda n: (policies[n][key], sum(p["goodput_rps"] for p in policies[n]["points"]))
               ) if names else None


def comparison(doc: dict[str, Any], contenders: list[Contender], scenario: str) -> dict[str, Any]:
    """Ratios (None where the peer never reached 90 % even at the lowest rate: then the target counts
    as met if ours did), targets, and which contenders still kept 90 % at the highest rate swept."""
    pol = doc["policies"]
    peers = [c.name for c in contenders if c.is_peer_alone and c.name in pol]
    ratios: dict[str, float | None] = {}
    targets: list[dict[str, Any]] = []

    unresolved = {False: [n for n in pol if _at_top(pol[n]["points"], False)],
                  True: [n for n in pol if _at_top(pol[n]["points"], True)]}

    def higher(name: str, a: str, b: str, key: str, goal: float) -> None:
        every = key == "max_goodput_per_class_rps"
        ratios[f"every class {name}" if every else name] = value = _ratio(pol[a][key], pol[b][key])
        met = value >= goal if value is not None else pol[a][key] > 0
        # a contender still >= 90 % at the highest rate has a max goodput of at least that rate
        bound = ("unknown" if b in unresolved[every] else "lower" if a in unresolved[every]
                 else "peer below 90 % at every rate" if value is None else "exact")
        what = "every-class max goodput" if every else "max goodput"
        targets.append({"name": f"{what} {name}", "value": value, "target": goal, "met": met, "bound": bound})

    best = _best(pol, peers, "max_goodput_rps")
    best_every = _best(pol, peers, "max_goodput_per_class_rps")
    if "flowprefill" in pol and best and best_every:
        higher(f"flowprefill/{best}", "flowprefill", best, "max_goodput_rps", TARGETS.get(scenario, 1.0))
        higher(f"flowprefill/{best_every}", "flowprefill", best_every, "max_goodput_per_class_rps",
               EVERY_CLASS_TARGET)
    for c in (c for c in contenders if c.via_gateway and c.name in pol):
        if c.server.name in pol:
            higher(f"{c.name}/{c.server.name}", c.name, c.server.name, "max_goodput_rps", GATEWAY_TARGET)
        fcfs = c.server.name.replace("-priority-", "-fcfs-")
        if fcfs != c.server.name and fcfs in pol:  # reported beside, no target of its own
            ratios[f"{c.name}/{fcfs}"] = _ratio(pol[c.name]["max_goodput_rps"], pol[fcfs]["max_goodput_rps"])
    tails = {name: t for name in pol if (t := worst_tail_at_knee(pol[name]["points"])) is not None}
    if "flowprefill" in pol:
        tail = tails.get("flowprefill")
        value = tail["factor"] if tail else None
        targets.append({"name": "flowprefill worst class p99 TTFT / its target, at its highest rate >= 90 %"
                        + (f" ({tail['class']}, {tail['rate']:g} req/s)" if tail else ""),
                        "value": value, "target": TAIL_TARGET_FACTOR, "lower_is_better": True,
                        "met": value is not None and value <= TAIL_TARGET_FACTOR})
    if "flowprefill" in pol and scenario == "hogs":
        targets += every_rate_targets(pol, peers, doc["classes"]["interactive"]["ttft_ms"])
    if "flowprefill" in pol and scenario in ("contended", "step"):
        p99 = interactive_p99_at_knee(pol["flowprefill"]["points"])
        value = None if p99 is None else round(p99 / doc["classes"]["interactive"]["ttft_ms"], 3)
        targets.append({"name": "flowprefill interactive p99 TTFT / its target, at its highest rate >= 90 %",
                        "value": value, "target": P99_TARGET_FACTOR, "lower_is_better": True,
                        "met": value is not None and value <= P99_TARGET_FACTOR})
    return {"ratios": ratios, "targets": targets, "best_peer": best, "best_peer_every_class": best_every,
            "unresolved": unresolved[False], "unresolved_every_class": unresolved[True], "tails_at_knee": tails}


def every_rate_targets(pol: dict[str, Any], peers: list[str], interactive_ms: float) -> list[dict[str, Any]]:
    """FlowPrefill's worst rate for interactive p99 TTFT / its target (unanswered interactive requests:
    None, not met) and for its overall attainment / the best peer's at that rate."""
    ours = {p["rate"]: p for p in pol["flowprefill"]["points"]}
    target_ms = interactive_ms
    factors = {}
    for rate, p in ours.items():
        c = p["per_class"].get("interactive")
        if c is not None:
            whole = c.get("failed", 0) <= 0.01 * c.get("n", 0) and c.get("ttft_p99_ms") is not None
            factors[rate] = round(c["ttft_p99_ms"] / target_ms, 3) if whole else None
    worst = max(factors, key=lambda r: math.inf if factors[r] is None else factors[r]) if factors else None
    value = factors[worst] if worst is not None else None
    out = [{"name": "flowprefill interactive p99 TTFT / its target, worst rate"
            + (f" ({worst:g} req/s)" if worst is not None else ""), "value": value, "target": HOGS_P99_FACTOR,
            "lower_is_better": True, "met": value is not None and value <= HOGS_P99_FACTOR}]
    theirs = {r: max(p["attainment"] for n in peers for p in pol[n]["points"] if p["rate"] == r)
              for r in ours if any(p["rate"] == r for n in peers for p in pol[n]["points"])}
    if not theirs:  # no peer ran at any of our rates: nothing to compare
        return out
    # a peer at 0 %: ours is at least as good whatever it attained
    ratios = {r: ours[r]["attainment"] / best if best > 0 else math.inf for r, best in theirs.items()}
    low = min(ratios, key=lambda r: ratios[r])
    out.append({"name": f"flowprefill attainment / the best peer's, worst rate ({low:g} req/s)",
                "value": None if ratios[low] == math.inf else round(ratios[low], 3), "target": HOGS_ATTAINMENT_RATIO,
                "met": ratios[low] >= HOGS_ATTAINMENT_RATIO})
    return out


def _at_top(points: list[dict[str, Any]], every_class: bool) -> bool:
    """Still >= 90 % (overall, or its worst class) at the highest rate swept: max goodput unresolved."""
    if not points:
        return False
    top = max(points, key=lambda q: q["rate"])
    att = min(c["attainment"] for c in top["per_class"].values()) if every_class else top["attainment"]
    return att >= report.ATTAINMENT_TARGET


def interactive_p99_at_knee(points: list[dict[str, Any]]) -> float | None:
    """Interactive p99 TTFT (ms) at the highest rate whose overall attainment is >= 90 %."""
    knee = report.knee([p for p in points if "interactive" in p["per_class"]])
    return knee["per_class"]["interactive"]["ttft_p99_ms"] if knee else None


def worst_tail_at_knee(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """At the highest rate whose overall attainment is >= 90 %: the class whose p99 TTFT is the most
    times its target, that factor and the rate (None: no such rate). A class
    with more than 1 % of its requests unanswered (failed) has no finite p99: factor None, and it is the
    worst (a starved class must not vanish from the figure because its p99 counts answers only)."""
    knee = report.knee(points)
    if knee is None:
        return None
    factors: dict[str, float | None] = {}
    for name, c in knee["per_class"].items():
        unanswered = c.get("failed", 0) > 0.01 * c.get("n", 0) or c.get("ttft_p99_ms") is None
        factors[name] = None if unanswered else c["ttft_p99_ms"] / c["ttft_target_ms"]  # as `sweep.point` recorded it
    if not factors:
        return None
    worst = max(factors, key=lambda name: math.inf if factors[name] is None else factors[name])
    factor = factors[worst]
    return {"class": worst, "factor": None if factor is None else round(factor, 3), "rate": knee["rate"]}


def summary_table(doc: dict[str, Any]) -> Table:
    peer = doc["peer"]
    t = Table(title=f"peer benchmark, {peer['scenario']['name']} ({doc['workload']['name']}, "
                    f"{doc['workload']['requests']} requests, {peer['dtype']}, {peer['placement']}"
                    + (f", TTFT targets x{doc['slo_scale']:g}" if doc.get("slo_scale", 1) != 1 else "") + ")")
    rates = sorted({p["rate"] for pol in doc["policies"].values() for p in pol["points"]})
    t.add_column("contender")
    for r in rates:
        t.add_column(f"{r:g}/s", justify="right")
    t.add_column("max goodput", justify="right")
    t.add_column("every class", justify="right")
    for name, pol in doc["policies"].items():
        by_rate = {p["rate"]: p for p in pol["points"]}
        more, every = ("+" if name in peer[k] else "" for k in ("unresolved", "unresolved_every_class"))
        t.add_row(name, *[f"{by_rate[r]['attainment']:.0%}" if r in by_rate else "-" for r in rates],
                  f"{pol['max_goodput_rps']:.2f}{more}", f"{pol['max_goodput_per_class_rps']:.2f}{every}")
    return t


def targets_table(doc: dict[str, Any]) -> Table:
    t = Table(title="ratios against the targets ('+': >= 90 % at the highest rate swept, so its max goodput is at "
                    "least that rate; '?': such a denominator)")
    for col in ("", "value", "target", "met"):
        t.add_column(col, justify="left" if not col else "right")
    for tg in doc["peer"]["targets"]:
        value = "-" if tg["value"] is None else f"{tg['value']:.2f}"
        value = {"lower": f">= {value}", "unknown": f"{value}?"}.get(tg.get("bound", "exact"), value)
        if tg.get("bound", "").startswith("peer below"):
            value = "peer < 90 % at every rate"
        t.add_row(tg["name"], value, f"{tg['target']:g}", "yes" if tg["met"] else "no")
    for name, tail in doc["peer"].get("tails_at_knee", {}).items():  # beside ours: every contender's tail
        if name != "flowprefill":
            t.add_row(f"{name} worst class p99 TTFT / its target, at its highest rate >= 90 % ({tail['class']}, "
                      f"{tail['rate']:g} req/s)", "unanswered" if tail["factor"] is None else f"{tail['factor']:.2f}",
                      "-", "")
    return t


def class_table(doc: dict[str, Any]) -> Table:
    """Per rate, contender and class: attainment, TTFT p50/p99 and the latest answer past its target."""
    t = Table(title=f"{doc['peer']['scenario']['name']}, per class: attainment, TTFT p50 / p99 ms, latest past "
                    "target ms")
    classes = sorted({c for pol in doc["policies"].values() for p in pol["points"] for c in p["per_class"]},
                     key=lambda c: DEFAULT_CLASSES[c].ttft_ms if c in DEFAULT_CLASSES else 0)
    for col in ("rate", "contender", *classes):
        t.add_column(col, justify="right")
    rows = sorted(((p["rate"], name, p) for name, pol in doc["policies"].items() for p in pol["points"]),
                  key=lambda x: (x[0], x[2]["order"]))
    for rate, name, p in rows:
        cells = []
        for c in classes:
            pc = p["per_class"].get(c)
            late = pc and pc["late_max_ms"]
            cells.append("-" if pc is None else f"{pc['attainment']:.0%} {_ms(pc['ttft_p50_ms'])}/"
                         f"{_ms(pc['ttft_p99_ms'])} {'-' if late is None else f'{late:+.0f}'}")
        t.add_row(f"{rate:g}", name, *cells)
    return t


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    n = len(doc["policies"])
    for i, (name, pol) in enumerate(doc["policies"].items()):
        pts = sorted(pol["points"], key=lambda p: p["rate"])
        style = "-" if name == "flowprefill" else "--" if name.startswith("gateway") else ":"
        line, = a.plot([p["rate"] for p in pts], [p["attainment"] * 100 for p in pts], style, marker="o", label=name)
        spread = [(p["rate"], min(p["attainment_runs"]) * 100, max(p["attainment_runs"]) * 100) for p in pts
                  if p.get("attainment_runs")]  # --repeats: every run's attainment, the point the median
        if spread:
            nudge = (i - (n - 1) / 2) * 0.12  # side by side, not on top of each other
            a.vlines([x + nudge for x, _, _ in spread], [lo for _, lo, _ in spread], [hi for *_, hi in spread],
                     color=line.get_color(), alpha=0.5, lw=3)
        inter = [(p["rate"], p["per_class"]["interactive"]["ttft_p99_ms"]) for p in pts
                 if p["per_class"].get("interactive", {}).get("ttft_p99_ms") is not None]
        b.plot([x for x, _ in inter], [y for _, y in inter], style, marker="o", label=name)
    a.axhline(90, color="grey", lw=0.8, ls=":")
    repeats = max((len(p.get("attainment_runs", [])) for pol in doc["policies"].values() for p in pol["points"]),
                  default=0)
    a.set(xlabel="offered rate (req/s)", ylabel="TTFT SLO attainment (%)", ylim=(0, 102),
          title="attainment vs rate, every class" + (f" (median of {repeats} runs; bars: their range)"
                                                      if repeats > 1 else ""))
    b.axhline(doc["classes"]["interactive"]["ttft_ms"], color="grey", lw=0.8, ls=":")
    b.set(xlabel="offered rate (req/s)", ylabel="interactive TTFT p99 (ms, log)", yscale="log",
          title="interactive p99 TTFT (dotted: target)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    peer = doc["peer"]
    fig.suptitle(f"{peer['scenario'].get('describe', peer['scenario']['name'])}\n{doc['workload']['name']} on "
                 f"{doc['model']} ({peer['dtype']}), {peer['placement']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scenarios_table(docs: list[dict[str, Any]]) -> Table:
    """Every scenario's runs in one table: per scenario, rate and contender, overall attainment,
    interactive attainment and p99 TTFT, and the requests refused with 429 by class."""
    t = Table(title="every scenario: attainment, interactive p99 TTFT, 429s by class")
    for col in ("scenario", "rate", "contender", "overall", "int.", "int. p99 ms", "429s"):
        # fold, not cut: an 80-column log would show "vllm-prio…" for every vLLM configuration
        t.add_column(col, justify="left" if col in ("scenario", "contender", "429s") else "right", overflow="fold")
    for doc in docs:
        name = doc["peer"]["scenario"]["name"]
        rows = sorted(((p["rate"], p.get("order", 0), contender, p) for contender, pol in doc["policies"].items()
                       for p in pol["points"]), key=lambda x: x[:2])
        for rate, _, contender, p in rows:
            inter = p["per_class"].get("interactive", {})
            refused = ", ".join(f"{c} {pc['refused']}" for c, pc in p["per_class"].items() if pc.get("refused"))
            t.add_row(name, f"{rate:g}", contender, f"{p['attainment']:.0%}",
                      f"{inter['attainment']:.0%}" if inter else "-", _ms(inter.get("ttft_p99_ms")), refused or "0")
    return t
