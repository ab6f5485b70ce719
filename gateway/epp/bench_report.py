"""`flowprefill bench epp`'s table and plot (gateway/epp/bench.py measures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

TARGETS = {"request_phase_p50_ms": 1.0, "request_phase_p99_ms": 3.0, "one_core_picks_per_s": 2000.0}


def table(r: dict[str, Any]) -> Table:
    lat, th, disc = r["latency"], r["throughput"], r["discovery"]
    t = Table(title=f"endpoint picker ({lat['request_bytes']:,}-byte request body, one core)")
    for col in ("measure", "value", "target"):
        t.add_column(col, justify="left" if col == "measure" else "right")
    t.add_row("added latency, request phase, p50", f"{lat['request_phase_p50_ms']:.3f} ms", "<= 1 ms")
    t.add_row("added latency, request phase, p99", f"{lat['request_phase_p99_ms']:.3f} ms", "<= 3 ms")
    t.add_row("whole stream (response passed through), p50 / p99",
              f"{lat['stream_p50_ms']:.3f} / {lat['stream_p99_ms']:.3f} ms", "")
    if (g := r.get("latency_grpc_client")) is not None:
        t.add_row("with grpc's Python client: request phase p50 / p99",
                  f"{g['request_phase_p50_ms']:.3f} / {g['request_phase_p99_ms']:.3f} ms", "(upper bound)")
    t.add_row("picks per second on one core (request phase only)",
              f"{r['throughput_request_phase']['one_core_picks_per_s']:,.0f}", ">= 2,000")
    t.add_row("requests per second on one core (response passed through)", f"{th['one_core_picks_per_s']:,.0f}", "")
    if (g := r.get("throughput_request_phase_grpc_client")) is not None:
        t.add_row("picks per second on one core, grpc's Python client", f"{g['one_core_picks_per_s']:,.0f}",
                  "(its pace)")
    rounds = disc["rounds"]
    bound = disc["interval_s"] + disc["health_poll_s"]
    for key, what in (("join_first_request_s", "worker added: first request, max"),
                      ("join_listed_by_epp_s", "worker added: listed by the picker, max"),
                      ("leave_last_new_request_s", "worker removed: new requests until, max"),
                      ("leave_unlisted_by_epp_s", "worker removed: unlisted by the picker, max")):
        t.add_row(what, f"{max(x[key] for x in rounds):.2f} s", f"<= {bound:g} s")
    t.add_row("failed requests during the rounds", f"{disc['failed_requests']} of {disc['requests']:,}", "0")
    return t


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [("", r["latency"], "-")]
    if "latency_grpc_client" in r:
        runs = [(" (hand-written frames)", r["latency"], "-"),
                (" (grpc's Python client)", r["latency_grpc_client"], ":")]
    for client, lat, style in runs:
        for idx, name in ((0, "request phase"), (1, "whole stream")):
            v = np.sort([s[idx] for s in lat["raw_ms"]])
            left.step(v, np.arange(1, len(v) + 1) / len(v), where="post", ls=style, color=f"C{idx}",
                      label=name + client)
    left.set_xlabel("ms per request (client included)")
    left.set_ylabel("share of requests")
    left.set_title("latency the picker adds")
    left.legend(fontsize=7)
    keys = ["join_first_request_s", "join_listed_by_epp_s", "leave_last_new_request_s", "leave_unlisted_by_epp_s"]
    rounds = r["discovery"]["rounds"]
    for i, key in enumerate(keys):
        right.scatter([i] * len(rounds), [x[key] for x in rounds], color=f"C{i}")
    right.axhline(r["discovery"]["interval_s"] + r["discovery"]["health_poll_s"], color="grey", ls="--",
                  label="one lookup interval + one health poll")
    right.set_xticks(range(len(keys)), ["joined:\nfirst request", "joined:\nlisted", "left:\nlast new request",
                                        "left:\nunlisted"])
    right.set_ylabel("seconds after the DNS change")
    right.set_title(f"discovery ({r['discovery']['failed_requests']} failed requests)")
    right.legend()
    fig.suptitle(r["command"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
