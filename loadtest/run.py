"""`flowprefill loadtest`: run a Locust profile headless against a gateway (or any OpenAI-compatible
server) and write SPEC's goodput.json (engine "http"), requests.csv and goodput.png.

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
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from loadtest.profiles import ProfileError, load_profile

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flowprefill loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="steady", help="steady | ramp | burst | azure, or a profile TOML file")
    p.add_argument("--host", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--rate", type=float, default=None, help="override the profile's rate (req/s)")
    p.add_argument("--requests", type=int, default=None, help="override the profile's request cap")
    p.add_argument("--max-tokens", type=int, default=None, help="override the profile's output tokens")
    p.add_argument("--processes", type=int, default=0,
                   help="Locust worker processes (0: one process, no master); N: a master and N workers")
    p.add_argument("--max-in-flight", type=int, default=128, help="users per load-generating process")
    p.add_argument("--drain-s", type=float, default=120.0, help="wait this long for answers after the last arrival")
    p.add_argument("--label", default="http", help="name of this run in goodput.json (e.g. the server's policy)")
    p.add_argument("--out", default="bench-results/loadtest")
    args = p.parse_args(argv)
    console = Console()

    try:
        profile = load_profile(args.profile, rate=args.rate, requests=args.requests, max_tokens=args.max_tokens)
        n = len(profile.schedule())
    except ProfileError as exc:
        console.print(f"[red]error:[/] {exc}", soft_wrap=True, markup=True, highlight=False)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("goodput.json", "requests.csv", "goodput.png"):
        (out / stale).unlink(missing_ok=True)
    resolved = out / "profile.json"  # the profile with its overrides: every Locust process reads it
    resolved.write_bytes(msgspec.json.encode(profile))
    console.print(f"[bold]loadtest[/] {profile.name or profile.kind}: {n} requests against {args.host} "
                  f"({'1 process' if not args.processes else f'master + {args.processes} workers'})")

    common = ["-f", str(LOCUSTFILE), "--load-profile", str(resolved), "--max-in-flight", str(args.max_in_flight),
              "--drain-s", str(args.drain_s), "--label", args.label, "--flowprefill-out", str(out)]
    master = [sys.executable, "-m", "locust", *common, "--headless", "--host", args.host, "--loglevel", "WARNING",
              "--csv", str(out / "locust")]
    workers: list[list[str]] = []
    if args.processes:
        port = _free_port()
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
        console.print(f"[red]error:[/] Locust exited with {rc} and wrote no report")
        return 1
    doc: dict[str, Any] = json.loads(report.read_text())
    doc["loadgen"] |= {"processes": 1 + len(workers), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                       "cores_used": round(cpu / wall, 3), "machine_cores": os.cpu_count()}
    doc["command"] = "flowprefill loadtest " + " ".join(argv if argv is not None else sys.argv[2:])
    report.write_text(json.dumps(doc, indent=2))
    _summary(console, doc)
    console.print(f"wrote {report}, {out / 'requests.csv'} and {out / 'goodput.png'}")
    return 0 if doc["accounting"]["missing"] == 0 else 1


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(console: Console, doc: dict[str, Any]) -> None:
    label = next(iter(doc["policies"]))
    t = Table(title=f"{label} @ {doc['host']}: {doc['workload']['name']}")
    for col in ("class", "requests", "failed", "target ms", "attainment", "TTFT p50 ms", "TTFT p99 ms", "TBT p99 ms"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for r in doc["per_class"]:
        t.add_row(r["slo_class"], str(r["requests"]), str(r["failed"]), f"{r['ttft_target_ms']:g}",
                  f"{r['attainment']:.0%}", _f(r["ttft_p50_ms"]), _f(r["ttft_p99_ms"]), _f(r["tbt_p99_ms"]))
    console.print(t)
    pts = doc["policies"][label]["points"]
    for pt in pts:
        console.print(f"offered {pt['rate']:.3g} req/s: attainment {pt['attainment']:.0%}, "
                      f"goodput {pt['goodput_rps']:.3g} req/s")
    a, lg = doc["accounting"], doc["loadgen"]
    console.print(f"accounting: scheduled {a['scheduled']} = sent {a['sent']} + missing {a['missing']}; "
                  f"sent = succeeded {a['succeeded']} + failed {a['failed']}")
    console.print(f"load generator: {lg['cores_used']:.2f} of {lg['machine_cores']} cores, send lag p99 "
                  f"{lg['lag_p99_ms']:.1f} ms, {lg['late_over_50ms']} requests sent > 50 ms late")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
