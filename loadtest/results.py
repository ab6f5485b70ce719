"""What a Locust run measured: one record per scheduled request, turned into goodput.json (the
schema of docs/reference.md, engine "http"), a per-request CSV, a PNG and the web UI's per-class SLO
table."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from engine.protocol.slo import DEFAULT_CLASSES, SLOClass
from loadtest import report

if TYPE_CHECKING:
    from locust.env import Environment

    from loadtest.locustfile import Run
    from loadtest.profiles import Profile, Schedule


class Record(msgspec.Struct, kw_only=True):
    index: int  # position in the schedule
    slo_class: str
    input_tokens: int
    scheduled_s: float  # due time, from the start of the run
    lag_s: float = 0.0  # how late the load generator sent it
    status: int = 0  # HTTP status (0: no response)
    applied_class: str = ""  # the class the server says it applied
    ttft_s: float | None = None
    gaps_s: list[float] = []  # between streamed tokens
    e2e_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    def to_wire(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Record:
        return msgspec.convert(data, cls)


CONNECT_FAILED = "connection failed"  # a request's error when it got no connection (refused, reset, unresolved)


def no_answer(exc: BaseException | None) -> str:
    """The error of a request that got no HTTP answer (requests' exception, which Locust keeps): it
    could not connect (or lost the connection before an answer), or it connected and got none in time;
    by the innermost cause, `connection failed (Connection refused)`."""
    import requests

    cause = exc
    while cause is not None:  # requests' ConnectionError < urllib3's MaxRetryError < the socket's error
        inner = getattr(cause, "reason", None) or cause.__cause__ or next(
            (a for a in cause.args if isinstance(a, BaseException)), None)
        if not isinstance(inner, BaseException) or inner is cause:
            break
        cause = inner
    reason = (getattr(cause, "strerror", None) or str(cause) or type(cause).__name__) if cause else "unknown"
    kind = CONNECT_FAILED if isinstance(exc, requests.exceptions.ConnectionError) else "no answer"
    return f"{kind} ({reason})"


def outcomes(records: list[Record], classes: Mapping[str, SLOClass] = DEFAULT_CLASSES) -> list[report.Outcome]:
    return [report.Outcome(r.slo_class, classes[r.slo_class].ttft_ms / 1000 if r.slo_class in classes
                           else 0.0, r.ttft_s if r.ok else None) for r in records]


def class_table(records: list[Record]) -> list[dict[str, Any]]:
    """Per class: requests, failures, attainment and TTFT/TBT percentiles (the web UI's SLO tab)."""
    rows = []
    for name in sorted({r.slo_class for r in records}):
        mine = [r for r in records if r.slo_class == name]
        ttft = np.array([r.ttft_s for r in mine if r.ok]) * 1000
        tbt = np.array([g for r in mine if r.ok for g in r.gaps_s]) * 1000
        target = DEFAULT_CLASSES[name].ttft_ms if name in DEFAULT_CLASSES else float("nan")
        attained = sum(1 for r in mine if r.ok and r.ttft_s * 1000 <= target)
        rows.append({"slo_class": name, "requests": len(mine), "failed": sum(not r.ok for r in mine),
                     "ttft_target_ms": target, "attained": attained, "attainment": round(attained / len(mine), 4),
                     "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
                     "tbt_p50_ms": _pct(tbt, 50), "tbt_p99_ms": _pct(tbt, 99)})
    return rows


def percent(share: float) -> str:
    """An attainment (a share) as the command line, the web UI and the plot show it."""
    return f"{share:.0%}"


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if len(values) else None


def write(out: Path, profile: Profile, schedule: Schedule, records: dict[int, Record], host: str, model: str,
          label: str, preempted: dict[str, int] | None = None, cpu: dict[str, float] | None = None
          ) -> dict[str, Any]:
    """goodput.json (docs/reference.md's schema, engine "http"; one point per offered-rate phase),
    requests.csv and goodput.png. Requests with no record count as failed: nothing is dropped from
    the accounting. `preempted`: the server's preemptions during the run by "victim<-by" class pair
    (None: not readable); a one-point run's point carries their total. `cpu`: the CPU seconds the
    workers' compute threads and serving sides took meanwhile, and the serving side's share."""
    out.mkdir(parents=True, exist_ok=True)
    w = schedule.workload
    full = []
    for i, tr in enumerate(w.requests):
        full.append(records.get(i) or Record(index=i, slo_class=tr.slo_class, input_tokens=tr.input_tokens,
                                             scheduled_s=tr.arrival_s, error="no result (never sent or reported)"))
    points = []
    for rate in sorted(set(schedule.phase)):
        mine = [r for r, ph in zip(full, schedule.phase, strict=True) if ph == rate]
        points.append(report.point(round(rate, 4), outcomes(mine)))
    total = None if preempted is None else sum(preempted.values())
    if total is not None and len(points) == 1:
        points[0]["preemptions"] = total
    succeeded = sum(r.ok for r in full)
    accounting = {"scheduled": len(w.requests), "sent": len(records), "succeeded": succeeded,
                  "failed": len(records) - succeeded, "missing": len(w.requests) - len(records)}
    lag = np.array([r.lag_s for r in records.values()] or [0.0]) * 1000  # measured where each was sent
    doc = report.report(
        {"name": w.name, "source": w.source, "requests": len(w.requests), "class_rule": w.class_rule},
        "http", model, 1.0, {k: {"ttft_ms": c.ttft_ms, "tbt_ms": c.tbt_ms} for k, c in DEFAULT_CLASSES.items()},
        {label: points},
        extra={"host": host, "profile": msgspec.to_builtins(profile), "accounting": accounting,
               "server": {"preemptions": total, "preemptions_by_class": preempted, "cpu": cpu},
               "per_class": class_table(full),
               "errors": _errors(full),
               "loadgen": {"lag_p50_ms": float(np.percentile(lag, 50)), "lag_p99_ms": float(np.percentile(lag, 99)),
                           "lag_max_ms": float(lag.max()), "late_over_50ms": int((lag > 50).sum())}})
    (out / "goodput.json").write_text(json.dumps(doc, indent=2))
    with (out / "requests.csv").open("w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["index", "scheduled_s", "lag_ms", "slo_class", "applied_class", "input_tokens", "status",
                     "ttft_ms", "tbt_mean_ms", "e2e_ms", "error"])
        for r in full:
            wr.writerow([r.index, f"{r.scheduled_s:.4f}", f"{r.lag_s * 1000:.2f}", r.slo_class, r.applied_class,
                         r.input_tokens, r.status, _ms(r.ttft_s), _ms(sum(r.gaps_s) / len(r.gaps_s) if r.gaps_s
                                                                      else None), _ms(r.e2e_s), r.error or ""])
    plot(full, doc, out / "goodput.png")
    return doc


def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1000:.2f}"


def _errors(records: list[Record]) -> dict[str, int]:
    """Failures counted by cause: an HTTP error by its status and the OpenAI error body's `code`
    (`HTTP 429 predicted_slo_miss`), any other by its first 80 characters."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.error:
            continue
        if r.error.startswith("HTTP"):
            key = _http_cause(r.error)
        else:
            key = r.error.split(":")[0] if r.error.startswith("interrupted") else r.error[:80]
        counts[key] = counts.get(key, 0) + 1
    return counts


def _http_cause(error: str) -> str:
    status, _, body = error.partition(": ")
    try:
        detail = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):  # not an OpenAI error body (a proxy's page), or cut short
        detail = {}
    code = (detail.get("code") or detail.get("type")) if isinstance(detail, dict) else None
    return f"{status} {code}" if code else status


def plot(records: list[Record], doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(sorted({r.slo_class for r in records})):
        ttft = np.sort([r.ttft_s * 1000 for r in records if r.slo_class == name and r.ok])
        n = sum(r.slo_class == name for r in records)
        color = f"C{i}"
        if len(ttft):  # failures never reach 1.0: the curve tops out at the success share
            ax1.step(ttft, np.arange(1, len(ttft) + 1) / n, where="post", color=color, label=name)
        if name in DEFAULT_CLASSES:
            ax1.axvline(DEFAULT_CLASSES[name].ttft_ms, color=color, linestyle=":", linewidth=1)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms, log); dotted: class target")
    ax1.set_ylabel("share of requests")
    ax1.set_title("TTFT by SLO class")
    ax1.legend()
    rows = doc["per_class"]
    bars = ax2.bar([r["slo_class"] for r in rows], [r["attainment"] for r in rows],
                   color=[f"C{i}" for i in range(len(rows))])
    # A class that attained nothing has no bar: its label still says what happened to its requests.
    ax2.bar_label(bars, [f"{percent(r['attainment'])}: {r['attained']} of {r['requests']}"
                         + (f", {r['failed']} failed" if r["failed"] else "") for r in rows], padding=2)
    ax2.axhline(report.ATTAINMENT_TARGET, color="k", linestyle="--", linewidth=1, label="target")
    ax2.set_ylim(0, 1.15)  # room for the labels over full bars
    ax2.set_ylabel("TTFT SLO attainment")
    label = next(iter(doc["policies"]))
    ax2.set_title(f"{label}: goodput {sum(p['goodput_rps'] for p in doc['policies'][label]['points']):.2f} req/s "
                  f"({doc['workload']['name']})")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def extend_web_ui(environment: Environment, run: Run) -> None:
    """A "SLO" tab in Locust's web UI: attainment and TTFT/TBT percentiles per class, live."""
    from flask import request

    web_ui = environment.web_ui
    assert web_ui is not None
    columns = ["slo_class", "requests", "failed", "ttft_target_ms", "attainment", "ttft_p50_ms", "ttft_p99_ms",
               "tbt_p50_ms", "tbt_p99_ms"]
    web_ui.template_args["extended_tabs"] = [{"title": "SLO", "key": "slo"}]
    web_ui.template_args["extended_tables"] = [
        {"key": "slo", "structure": [{"key": c, "title": c.replace("_", " ")} for c in columns]}]

    @web_ui.app.after_request
    def _slo_stats(response: Any) -> Any:
        if request.path != "/stats/requests" or not response.is_json:
            return response
        rows = [r | {"attainment": percent(r["attainment"])}
                for r in class_table(list(run.records.values()) + list(run.pending))]
        response.set_data(json.dumps({**response.json, "extended_stats": [{"key": "slo", "data": rows}]}))
        return response
