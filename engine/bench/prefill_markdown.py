"""The tables of `flowprefill bench prefill` as Markdown (prefill.md), in the Benchmarks page's format,
so a run's numbers reach the docs or a report without retyping."""

from __future__ import annotations

from typing import Any

from engine.bench.prefill_plot import HF, PREEMPTIBLE, UNSPLIT, size_label


def _pct(x: float, digits: int = 1) -> str:
    return f"{x:+.{digits}f} %".replace("-", "−")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def throughput_table(r: dict[str, Any]) -> str:
    names = [n for n in (UNSPLIT, PREEMPTIBLE, HF) if n in r["contenders"]]
    header = ["prompt", *(f"{n} tok/s (ms)" for n in names)]
    header += [f"{n.removeprefix('ours ')} / transformers" for n in r["ratio_vs_transformers"]]
    header += ["predicted ms (error)", "steps unsplit / split"]
    peak = r.get("matmul_peak_gflops")
    if peak:  # results files from before the GFLOP/s column have none
        header.append(f"preemptible GFLOP/s (of {peak:,.0f} matmul peak)")
    rows = []
    for n in r["sizes"]:
        k = str(n)
        row = [size_label(n)]
        row += [f"{r['tokens_per_s'][name][k]:,.0f} ({r['median_s'][name][k] * 1e3:,.1f})" for name in names]
        row += [f"{per[k]:.2f}×" for per in r["ratio_vs_transformers"].values()]
        pred, meas = r["predicted_s"][k], r["median_s"][UNSPLIT][k]
        row.append(f"{pred * 1e3:,.1f} ({_pct(100 * (pred - meas) / meas, 0)})")
        row.append(f"{r['steps'][UNSPLIT][k]} / {r['steps'][PREEMPTIBLE][k]}")
        if peak:
            rate = r["gflops"][PREEMPTIBLE][k]
            row.append(f"{rate:,.0f} ({100 * rate / peak:.0f} %)")
        rows.append(row)
    return _table(header, rows)


def overhead_table(r: dict[str, Any]) -> str:
    line = any("linear_blocks_s" in p for p in r["per_size"].values())
    header = ["prompt", "steps (split / off)", "off ms", "preemptible ms", "slower (ratio of medians)",
              "slower (median of pairs)", *(["blocks from the line: steps, slower"] if line else [])]
    rows = []
    for n in r["sizes"]:
        p = r["per_size"][str(n)]
        row = [size_label(n), f"{p['steps_preemptible']} / {p['steps_off']}", f"{p['median_off_s'] * 1e3:,.1f}",
               f"{p['median_preemptible_s'] * 1e3:,.1f}", _pct(p["overhead_pct"]),
               _pct(p["median_paired_overhead_pct"])]
        if line:
            row.append(f"{p['steps_linear_blocks']}, {_pct(p['linear_blocks_overhead_pct'])}")
        rows.append(row)
    return _table(header, rows)


def stop_table(r: dict[str, Any]) -> str:
    labels = {"split": "with split", "unsplit": "without split"}
    header = ["prompt"]
    for mode in r["modes"]:
        header += [f"{labels.get(mode, mode)}: n", "p50 ms", "p99 ms", "max ms", "urgent TTFT p99"]
    rows = []
    for n in r["sizes"]:
        row = [size_label(n)]
        for per in r["modes"].values():
            c = per[str(n)]
            row += [str(c["n"]), f"{c['p50_ms']:.2f}", f"{c['p99_ms']:.2f}", f"{c['max_ms']:.2f}",
                    f"{c['urgent_ttft_p99_ms']:.0f} ms"]
        rows.append(row)
    return _table(header, rows)


def markdown(results: dict[str, Any]) -> str:
    parts = [f"<!-- {results['command']} · {results['started_at']} -->"]
    for key, title, table in (("throughput", "Prefill throughput", throughput_table),
                              ("overhead", "Checkpoint overhead", overhead_table),
                              ("stop_latency", "Preemption stop latency", stop_table)):
        if key in results:
            parts += [f"## {title}", table(results[key])]
    return "\n\n".join(parts) + "\n"
