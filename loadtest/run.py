"""`flowprefill loadtest`: run a Locust profile headless against a gateway (or any OpenAI-compatible
server) and write <out>/goodput.json (the schema of docs/reference.md, engine "http"), requests.csv and
goodput.png; with several policies or rates, one such folder per run and <out>/goodput.json for all.

    flowprefill loadtest --profile burst --host http://127.0.0.1:8000
    flowprefill loadtest --profile azure --rate 3 --processes 2 --host http://127.0.0.1:8000

With --processes N, Locust runs distributed: a master and N worker processes on this machine.
The load generator's own CPU use is measured and written to goodput.json (`loadgen`), since on a small
machine it competes with the server it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from gateway.cli.common import CommandLineError, Parser
from gateway.cli.console import results_console
from gateway.processes import free_port, start, stop, wait_healthy
from loadtest import report
from loadtest.goodput import RATIO_PAIRS
from loadtest.priority import ORDERS
from loadtest.profiles import Profile, ProfileError, load_profile
from loadtest.results import CONNECT_FAILED, percent

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STAGE, FAILED = ".partial", "failed"  # under --out: the run in progress; the last failed run's files
MOST = 0.5  # past this share of requests unconnected, a run measured the network, not the server
REACH_TIMEOUT_S = 10.0  # the check before a run: a server busy with another load still answers within it


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill loadtest", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--profile", default="steady",
                   help="steady | ramp | burst | burst-tiny | azure, or a profile TOML file")
    p.add_argument("--host", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--rate", type=float, default=None, help="override the profile's rate (req/s)")
    p.add_argument("--rates", default=None, help="comma-separated rates: one run (one report point) per rate")
    p.add_argument("--requests", type=int, default=None, help="override the profile's request cap")
    p.add_argument("--max-tokens", type=int, default=None, help="override the profile's output tokens")
    p.add_argument("--processes", type=int, default=0,
                   help="Locust worker processes (0: one process, no master); N: a master and N workers")
    p.add_argument("--max-in-flight", type=int, default=128, help="users per load-generating process")
    p.add_argument("--drain-s", type=float, default=120.0, help="wait this long for answers after the last arrival")
    p.add_argument("--label", default="http", help="name of this run in goodput.json (e.g. the server's policy)")
    p.add_argument("--send-priority", nargs="?", const="lower_first", choices=ORDERS, default=None,
                   help="the host is a plain OpenAI server (vLLM, SGLang): send each class as the body's "
                        "`priority` too, as the gateway does (lower_first, the default: vLLM's convention, "
                        "interactive 0 .. batch 3; higher_first: SGLang's default)")
    p.add_argument("--serve-policies", default=None,
                   help="comma-separated policies: start `flowprefill serve --policy P` for each (instead of "
                        "--host) and report them side by side")
    p.add_argument("--serve-args", default="--threads 1 --model tiny",
                   help="extra `flowprefill serve` options with --serve-policies (default: one core left to Locust, "
                        "and the embedded tiny model, whose speed the default SLO classes were set for)")
    p.add_argument("--out", default="bench-results/loadtest",
                   help="directory for goodput.json, goodput.png and each run's Locust CSVs "
                        "(default: bench-results/loadtest)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = results_console()

    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    try:
        profiles = [load_profile(args.profile, rate=r, requests=args.requests, max_tokens=args.max_tokens)
                    for r in rates]
        sizes = [len(pr.schedule()) for pr in profiles]
    except (ProfileError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}", soft_wrap=True, markup=True, highlight=False)
        return 2
    if not args.serve_policies:
        check_reachable(args.host)  # one line and exit 2, before anything is run or written
    out = Path(args.out)
    stage = out / STAGE  # this run's files, moved into `out` only if it succeeds
    shutil.rmtree(stage, ignore_errors=True)
    docs: list[dict[str, Any]] = []
    try:
        _runs(list(zip(profiles, sizes, strict=True)), len(rates), args, stage, console, docs)
    except RunFailed as exc:
        _write_report(docs, argv, stage, console)
        failed = _set_aside(stage, out)
        print(f"flowprefill loadtest: error: {exc}; this run's files are in {failed}, nothing in {out} "
              "was replaced", file=sys.stderr, flush=True)
        return 1
    except BaseException:  # interrupted: set aside all the same, so that the next run starts clean
        _set_aside(stage, out)
        raise
    _write_report(docs, argv, stage, console)
    _publish(stage, out)
    console.print(f"wrote {out / 'goodput.json'} and {out / 'goodput.png'}")
    return 0


class RunFailed(Exception):
    """A run that measured nothing to keep (the server went away, Locust wrote no report, requests
    unaccounted for): said in one line, exit 1, its files set aside."""


def check_reachable(host: str) -> None:
    """CommandLineError (one line, exit 2) unless `host` takes a connection and answers HTTP: a run
    against nothing fails every request and measures nothing. A slow answer is an answer."""
    import httpx

    try:
        httpx.get(f"{host.rstrip('/')}/v1/models", timeout=REACH_TIMEOUT_S)
    except httpx.ReadTimeout:
        return
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise CommandLineError(f"cannot reach {host}: {_said(exc)} (nothing was run)") from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise CommandLineError(f"--host {host}: not a base URL such as http://127.0.0.1:8000 ({exc})") from None
    except httpx.TransportError as exc:
        raise CommandLineError(f"{host} does not answer HTTP: {_said(exc)} (nothing was run)") from None


def _said(exc: Exception) -> str:
    return str(exc) or type(exc).__name__  # httpx's timeouts may say nothing


def _runs(profiles: list[tuple[Profile, int]], rates: int, args: argparse.Namespace, stage: Path,
          console: Console, docs: list[dict[str, Any]]) -> None:
    """Each policy's server (with --serve-policies) and each rate's Locust run, their docs into `docs`;
    RunFailed at the first that failed."""
    policies = args.serve_policies.split(",") if args.serve_policies else [None]
    several = len(policies) > 1 or rates > 1
    for policy in policies:
        server = _serve(policy, args.serve_args, console) if policy else None
        try:
            host = server[1] if server else args.host
            for profile, n in profiles:
                run_dir = stage / f"{policy or args.label}@{profile.rate or 'native'}" if several else stage
                pace = f"{profile.rate:g} req/s" if profile.rate else "the profile's pace"
                console.print(f"[bold]loadtest[/] {profile.name or profile.kind}: {n} requests at {pace} "
                              f"against {host} ({policy or args.label})")
                docs.append(_locust(profile, host, policy or args.label, run_dir, args))
                _check(docs[-1], host)
        finally:
            if server:
                stop(server[0])


def _check(doc: dict[str, Any], host: str) -> None:
    """RunFailed when most requests could not connect (the server is down or went away: no measure of
    it), or some have no record at all."""
    a = doc["accounting"]
    unconnected = sum(n for cause, n in doc["errors"].items() if cause.startswith(CONNECT_FAILED))
    if unconnected > MOST * a["scheduled"]:
        causes = ", ".join(cause.removeprefix(CONNECT_FAILED).strip(" ()") for cause in doc["errors"]
                           if cause.startswith(CONNECT_FAILED))  # "connection failed (Connection refused)"
        raise RunFailed(f"{unconnected} of {a['scheduled']} requests could not connect to {host} ({causes}): "
                        "the server is down or went away")
    if a["missing"]:
        raise RunFailed(f"{a['missing']} of {a['scheduled']} requests have no record (never sent, or their "
                        "Locust process never reported them)")


def _write_report(docs: list[dict[str, Any]], argv: list[str] | None, stage: Path, console: Console) -> None:
    """goodput.json for all runs (and, for several, their side-by-side table and goodput.png) in `stage`."""
    if not docs:
        return
    doc = _merge(docs, argv) if len(docs) > 1 else docs[0]
    doc["machine"] = _machine()
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "goodput.json").write_text(json.dumps(doc, indent=2))
    if len(docs) > 1:
        _side_by_side(console, doc)
        _plot_rates(doc, stage / "goodput.png")


def _publish(stage: Path, out: Path) -> None:
    """A succeeded run's files into `out`, each replacing its earlier version (a rename: a reader
    never sees half a file), files of earlier runs that this one did not write left as they are."""
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        target = out / path.relative_to(stage)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(stage)


def _set_aside(stage: Path, out: Path) -> Path:
    """A failed or interrupted run's files, as <out>/failed (replacing the last failed run's)."""
    failed = out / FAILED
    shutil.rmtree(failed, ignore_errors=True)
    if stage.exists():
        stage.rename(failed)
    return failed


def _locust(profile: Profile, host: str, label: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One headless Locust run (single process, or a master and --processes workers) writing into `out`
    (a fresh folder); RunFailed if it wrote no report."""
    console = results_console()
    out.mkdir(parents=True, exist_ok=True)
    resolved = out / "profile.json"  # the profile with its overrides: every Locust process reads it
    resolved.write_bytes(msgspec.json.encode(profile))
    common = ["-f", str(LOCUSTFILE), "--load-profile", str(resolved), "--max-in-flight", str(args.max_in_flight),
              "--drain-s", str(args.drain_s), "--label", label, "--flowprefill-out", str(out)]
    if args.send_priority:
        common += ["--send-priority", args.send_priority]
    master = [sys.executable, "-m", "locust", *common, "--headless", "--host", host, "--loglevel", "WARNING",
              "--csv", str(out / "locust")]
    workers: list[list[str]] = []
    if args.processes:
        port = free_port()
        master += ["--master", "--expect-workers", str(args.processes), "--master-bind-host", "127.0.0.1",
                   "--master-bind-port", str(port)]
        workers = [[sys.executable, "-m", "locust", *common, "--worker", "--master-host", "127.0.0.1",
                    "--master-port", str(port), "--loglevel", "WARNING"] for _ in range(args.processes)]
    t0, cpu0 = time.monotonic(), _children_cpu()
    procs = [subprocess.Popen(cmd) for cmd in [master, *workers]]
    try:
        rc = procs[0].wait()
        for w in procs[1:]:
            w.wait(timeout=30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    report = out / "goodput.json"
    if not report.exists():
        raise RunFailed(f"Locust exited with {rc} and wrote no report")
    doc: dict[str, Any] = json.loads(report.read_text())
    doc["loadgen"] |= {"processes": 1 + len(workers), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                       "cores_used": round(cpu / wall, 3), "machine_cores": os.cpu_count()}
    report.write_text(json.dumps(doc, indent=2))
    _summary(console, doc)
    return doc


def _serve(policy: str, extra: str, console: Console) -> tuple[subprocess.Popen, str]:
    port = free_port(span=2)  # serve puts its worker on the next port
    proc = start("serve", "--policy", policy, "--port", str(port), *shlex.split(extra))
    url = f"http://127.0.0.1:{port}"
    with console.status(f"starting flowprefill serve --policy {policy}…"):
        try:
            wait_healthy(url, proc, timeout=300)
        except (RuntimeError, TimeoutError):
            stop(proc)
            raise
    return proc, url


def _merge(docs: list[dict[str, Any]], argv: list[str] | None) -> dict[str, Any]:
    """Runs of several policies and rates in one goodput.json: a point per (policy, rate)."""
    policies: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        for name, pol in d["policies"].items():
            policies.setdefault(name, []).extend(pol["points"])
    first = docs[0]
    return report.report(
        first["workload"] | {"requests": max(d["workload"]["requests"] for d in docs)}, "http", first["model"], 1.0,
        first["classes"], policies, RATIO_PAIRS,
        extra={"runs": [{k: d[k] for k in ("host", "accounting", "per_class", "loadgen", "errors", "server")}
                        | {"policy": next(iter(d["policies"])), "rate": d["profile"]["rate"]} for d in docs],
               "accounting": {k: sum(d["accounting"][k] for d in docs) for k in first["accounting"]},
               "command": "flowprefill loadtest " + " ".join(argv if argv is not None else sys.argv[2:])})


def _side_by_side(console: Console, doc: dict[str, Any]) -> None:
    t = Table(title=f"goodput by policy and offered rate ({doc['workload']['name']}, over HTTP)",
              caption=report.BELOW_CAPTION)
    rates = sorted({pt["rate"] for pol in doc["policies"].values() for pt in pol["points"]})
    t.add_column("policy")
    for r in rates:
        t.add_column(f"{r:g} req/s", justify="right")
    t.add_column("max goodput", justify="right")
    for name, pol in doc["policies"].items():
        by_rate = {pt["rate"]: pt for pt in pol["points"]}
        t.add_row(name, *[f"{by_rate[r]['goodput_rps']:.2f} ({percent(by_rate[r]['attainment'])})" if r in by_rate
                          else "-" for r in rates], report.goodput_label(pol["max_goodput_rps"], pol["points"]))
    console.print(t)
    for k, v in doc["ratios"].items():
        console.print(f"{k}: {report.ratio_label(v)}{'' if v is None else 'x'}")


def _plot_rates(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pol in doc["policies"].items():
        pts = sorted(pol["points"], key=lambda p: p["rate"])
        ax.plot([p["rate"] for p in pts], [p["attainment"] for p in pts], marker="o", label=name)
    ax.axhline(doc["attainment_target"], color="k", linestyle="--", linewidth=1)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("TTFT SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Locust over HTTP: {doc['workload']['name']} ({doc['workload']['requests']} requests)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine() -> dict[str, Any]:
    import platform

    from loadtest.machine import cpu_count, cpu_model

    return {"cpu_count": cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg()}


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _summary(console: Console, doc: dict[str, Any]) -> None:
    label = next(iter(doc["policies"]))
    t = Table(title=f"{label} @ {doc['host']}: {doc['workload']['name']}")
    for col in ("class", "requests", "failed", "target ms", "attainment", "TTFT p50 ms", "TTFT p99 ms", "TBT p99 ms"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for r in doc["per_class"]:
        t.add_row(r["slo_class"], str(r["requests"]), str(r["failed"]), f"{r['ttft_target_ms']:g}",
                  percent(r["attainment"]), _f(r["ttft_p50_ms"]), _f(r["ttft_p99_ms"]), _f(r["tbt_p99_ms"]))
    console.print(t)
    pol = doc["policies"][label]
    for pt in pol["points"]:
        console.print(f"offered {pt['rate']:.3g} req/s: attainment {percent(pt['attainment'])}, "
                      f"goodput {pt['goodput_rps']:.3g} req/s")
    # what goodput.json's max goodput is, and why it is 0 beside a goodput above it (its note)
    why = (pol["max_goodput_note"] if pol["max_goodput_rps"] == 0
           else f"the highest rate with attainment >= {doc['attainment_target'] * 100:g} %")
    console.print(f"max goodput: {pol['max_goodput_rps']:.3g} req/s ({why})")
    server = doc.get("server") or {}
    if server.get("preemptions") is None:
        console.print("preemptions: unknown (the server's workers expose no flowprefill metrics to this host)")
    else:
        pairs = ", ".join(f"{v} of {k.replace('<-', ' by ')}" for k, v in server["preemptions_by_class"].items())
        console.print(f"preemptions (the server's workers, during the run): {server['preemptions']}"
                      + (f" ({pairs})" if pairs else ""))
    if cpu := server.get("cpu"):
        console.print(f"the workers' CPU: {cpu['compute_s']:.1f} s computing, {cpu['serving_s']:.1f} s serving "
                      f"(HTTP, tokenizing, JSON, SSE: {cpu['serving_share']:.1%})")
    a, lg = doc["accounting"], doc["loadgen"]
    console.print(f"accounting: scheduled {a['scheduled']} = sent {a['sent']} + missing {a['missing']}; "
                  f"sent = succeeded {a['succeeded']} + failed {a['failed']}")
    if doc.get("errors"):
        console.print("failed by cause: " + ", ".join(f"{n} {cause}" for cause, n in doc["errors"].items()))
    console.print(f"load generator: {lg['cores_used']:.2f} of {lg['machine_cores']} cores, send lag p99 "
                  f"{lg['lag_p99_ms']:.1f} ms, {lg['late_over_50ms']} requests sent > 50 ms late")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
