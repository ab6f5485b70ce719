"""`flowprefill plan`: how many prefill instances a workload needs to meet an SLO attainment target,
per policy.

For each policy, N instances are simulated behind the gateway's own routing (least predicted backlog
from each instance's GET /load, polled as the gateway polls it, plus its requests in flight; prefix
affinity within its slack where the trace names its prompts' blocks), each instance the real scheduler
and policy on one shared virtual clock (engine/sim/fleet.py), with a cost model (`cpu`: this machine
profiled, as `bench goodput` does, at the speed a short pilot of the real `serve` ran the workload's
first requests, per policy, engine/planner/speed.py; `MODEL@GPU`: roofline). The smallest N that
meets the target is found by doubling, then bisection (attainment grows with N); a run whose certain
misses already put it far below the target stops early. Reported at that N: attainment and goodput per
class, the instances FlowPrefill saves against each other policy, and the cost per million requests at a
price per instance-hour.

Writes <out>/plan.json, <out>/plan.png (attainment vs N per policy) and prints the table. Its check against
real `flowprefill serve` fleets on this machine is a benchmark of its own, `flowprefill bench planner`
(engine/bench/planner_validation/), which composes this command's steps (`parse`, `set_up`, `measure_speeds`,
`make_plan`, `write_outputs`) and adds the real fleets.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.progress import Progress

from engine.core.config import EngineConfig
from engine.core.scheduler import make_policy
from engine.model.calibration import measured_profile
from engine.planner.fleet import Planner, plan_policy
from engine.planner.measured import Planned
from engine.planner.report import plot, print_tables
from engine.planner.routing import DEFAULTS, KeyOf, trace_key
from engine.planner.speed import ENGINE_PASS, PILOT, PilotError, Speeds, planning_costs
from gateway.cli.common import Parser
from gateway.cli.console import results_console
from gateway.cli.serve import worker_threads
from loadtest import report
from loadtest.goodput import DEFAULT_POLICIES, Runner, measured_cost
from loadtest.machine import machine_info
from loadtest.workload import (
    PREFIX_BLOCK_TOKENS,
    ClassRule,
    TraceError,
    Workload,
    head,
    named_or_trace,
    scale_to_rate,
    skip,
)

DEFAULT_PRICE = 3.0  # USD per instance-hour: about an on-demand H100's in 2026 (a placeholder: pass yours)


def cost_per_million(n: int | None, price: float, w: Workload) -> float | None:
    """What serving the workload's requests costs per million: n instances for its duration."""
    if n is None or not w.requests or w.duration_s <= 0:
        return None
    return n * price * w.duration_s / 3600 / len(w.requests) * 1e6


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill plan", description=__doc__)
    add_plan_options(p)
    for flag in MOVED:
        p.add_argument(flag, action=_Moved)
    return p


# What `flowprefill plan` took to check itself against real fleets: now `flowprefill bench planner`'s.
MOVED = ("--against-serve", "--repeats", "--interleave-pilots")


class _Moved(argparse.Action):
    """An option that moved to `flowprefill bench planner`: hidden, and refused in one line saying where."""

    def __init__(self, option_strings: list[str], dest: str, **_kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} moved: flowprefill bench planner takes it, with every plan option")


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """Every option of `flowprefill plan` (`flowprefill bench planner` takes them all, and its own)."""
    p.add_argument("--workload", default="azure-mix",
                   help="azure-mix, long-mix, mooncake-4k or a trace file (Azure/BurstGPT CSV, JSONL)")
    p.add_argument("--requests", type=int, default=None, metavar="N", help="first N requests of the workload "
                   "(default: all)")
    p.add_argument("--skip", type=int, default=0, metavar="N", help="leave out the workload's first N requests "
                   "(before --requests; e.g. the ones a pilot ran)")
    p.add_argument("--cost", default="cpu", help="cost model: cpu (profile this machine), MODEL@GPU, e.g. "
                   "llama-3.1-8b@h100, or FILE.json: the CPU profile stored there, a plan.json's (the machine as "
                   "that plan profiled it, whatever this machine's cache holds now) or an engine's opcost-*.json "
                   "cache file (a machine profiled by a `serve` start-up there); no pilot then")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="cpu or FILE.json: torch threads of the engine profiled, its pilots' workers and "
                        "`bench planner`'s real fleets' (as `serve --threads`; default: what `serve --workers 1` "
                        "gives its worker here)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy names")
    p.add_argument("--target", type=float, default=report.ATTAINMENT_TARGET,
                   help="TTFT SLO attainment to meet, a share in (0, 1]")
    p.add_argument("--every-class", action="store_true", help="the target holds for each SLO class, not overall")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=None, metavar="R",
                      help="scale the arrivals to R requests/s (default: the trace's native rate)")
    rate.add_argument("--native-rate", action="store_true", help="the trace's own arrival times (the default)")
    p.add_argument("--max-instances", type=int, default=64, metavar="N", help="largest fleet to try")
    p.add_argument("--price", type=float, default=DEFAULT_PRICE, metavar="USD",
                   help="price of one instance-hour, for the cost per million requests")
    p.add_argument("--poll-s", type=float, default=1.0, help="how often the gateway reads each worker's /load")
    p.add_argument("--prefix-affinity-chars", type=int, default=DEFAULTS.prefix_affinity_chars,
                   help="the gateway's prefix_affinity_chars (0: no affinity; a trace that names no prompt blocks "
                        "is routed by load alone)")
    _add_speed_options(p)
    p.add_argument("--out", default="bench-results", help="directory for plan.json and plan.png")


def _add_speed_options(p: argparse.ArgumentParser) -> None:
    """How the plan learns the speed the workers will run at."""
    p.add_argument("--speed-from", default=None, metavar="DIR",
                   help="a pilot run's batch logs (its workers' $FLOWPREFILL_BATCH_LOG folder, or a `bench planner` "
                        "run's <out>/batch-logs, whose fleet of the same policy and size `bench planner` then "
                        "takes as each point's pilot): simulate at the "
                        "speed its machines ran, the median of measured over predicted prefill seconds (relative "
                        "to the workers' own calibration: the cost model should be theirs, e.g. --cost cpu on the "
                        "machine that ran the pilot)")
    p.add_argument("--pilot", type=int, default=PILOT, metavar="N",
                   help="cpu: first send N requests, at their arrival times, to a real `flowprefill serve "
                        "--workers 1` of each policy (with --threads, --no-calibrate; its batch log in "
                        "<out>/pilot/<policy>-w1/, : written -) and plan each policy at the speed its worker ran, a "
                        "factor per batch size (a worker served 7-15 %% slower than an engine pass one prompt at a "
                        "time read). The requests: the planned ones' first N, or the trace's N before them where "
                        "--skip leaves them (out of sample), at the planned ones' requests per second. "
                        "0: no pilot. Ignored with --speed-from")
    p.add_argument("--pilot-runs", type=int, default=1, metavar="R",
                   help="run each pilot R times (a fresh serve each, logs in run-<r>/) and plan at their batches "
                        "pooled: on a shared machine one pilot is one sample of a speed that moves from run to run "
                        "(two workers on 2 EPYC cores: 8 %% per batch size between five runs of one fleet)")
    p.add_argument("--engine-pass", type=int, default=ENGINE_PASS, metavar="N",
                   help="cpu, with --pilot 0: first run the workload's first N prompts through the engine (with "
                        "--threads), one at a time in this process, and plan at the speed it ran, a factor per batch "
                        "size (the operator profile alone was 1.2-1.4x optimistic); 0: plan from the profile alone")
    p.add_argument("--headroom", type=float, default=0.0, metavar="F",
                   help="plan for a machine F slower than measured (0.2: every prefill 20 %% longer), so that the "
                        "fleet still meets the target when the machine's speed drifts (on 2 shared cores it moved "
                        "by up to a quarter between runs minutes apart)")


def one_worker_threads() -> int:
    """The torch threads `serve --workers 1` gives its worker on this machine (one core stays with the
    gateway). The profile is cached per thread count: planned with torch's default (2 on 2 cores), a
    pilot's one-thread worker's speeds were applied to another profile."""
    return worker_threads(argparse.Namespace(num_threads=None, workers=1))


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line (one line), or None."""
    if not 0 < args.target <= 1:
        return f"--target {args.target:g}: a share of requests in (0, 1], e.g. 0.9"
    if args.max_instances < 1:
        return "--max-instances must be >= 1"
    if args.rate is not None and args.rate <= 0:
        return "--rate must be > 0"
    if args.skip < 0:
        return "--skip must be >= 0"
    if args.engine_pass < 0 or args.pilot < 0:
        return "--pilot and --engine-pass must be >= 0 (0: none)"
    if args.pilot_runs < 1:
        return "--pilot-runs must be >= 1"
    if not 0 <= args.headroom <= 10:
        return "--headroom must be in [0, 10] (0.2: plan for a machine 20 % slower)"
    if args.requests is not None and args.requests < 2:
        return "--requests must be >= 2 (a rate needs two arrivals)"
    if args.price < 0 or args.poll_s <= 0 or args.prefix_affinity_chars < 0:
        return "--price, --prefix-affinity-chars must be >= 0 and --poll-s > 0"
    for name in [x for x in args.policies.split(",") if x]:
        try:
            make_policy(name)
        except ValueError as exc:
            return str(exc)
    if not [x for x in args.policies.split(",") if x]:
        return "--policies names no policy"
    if args.speed_from is not None and not any(Path(args.speed_from).rglob("batches-*.jsonl")):
        return (f"--speed-from {args.speed_from}: no batch log there (batches-*.jsonl, written by workers run with "
                "FLOWPREFILL_BATCH_LOG set to that folder, or a `bench planner` run's <out>/batch-logs)")
    return None


def load_workload(args: argparse.Namespace) -> Workload:
    return _at_rate(args, _planned(args, _trace(args)))


def _trace(args: argparse.Namespace) -> Workload:
    return named_or_trace(args.workload, ClassRule())


def _planned(args: argparse.Namespace, trace: Workload) -> Workload:
    planned = skip(trace, args.skip) if args.skip else trace
    return head(planned, args.requests) if args.requests else planned


def _at_rate(args: argparse.Namespace, w: Workload) -> Workload:
    """`w` at --rate requests per second (as it is without one)."""
    return scale_to_rate(w, args.rate) if args.rate else w


def pilot_workload(args: argparse.Namespace, w: Workload) -> tuple[Workload, str]:
    """The requests a pilot sends (`--pilot N`) and where they come from: the planned ones' first N, at
    their own arrival times; or, where `--skip` leaves N before them (out of sample: the very requests
    planned are not measured first), the trace's N just before the planned ones, at the planned ones'
    requests per second (`at_rate_of`)."""
    n = min(args.pilot, len(w.requests))
    if args.skip < n:
        return head(w, n), f"the workload's first {n} requests"
    earlier = head(skip(_trace(args), args.skip - n), n)
    return at_rate_of(earlier, w), f"the trace's {n} requests before the planned ones, at their rate"


def at_rate_of(earlier: Workload, planned: Workload) -> Workload:
    """`earlier` at `planned`'s requests per second: what a request costs the CPU outside its batches (the
    worker's HTTP side, the gateway's hop) is paid at the planned rate. Two other pacings of azure-mix's 100
    requests before its 100-300, at 16 req/s, 2 EPYC cores, nine pilots a run, made the pilots slower than
    the fleets they planned: the planned clock's factor (7.0 req/s, a third of the planned prompt tokens per
    second) left one worker idle before half its batches (the fleet's runs 1 %) and planned it 6-8 points
    pessimistic in two of three runs; the planned prompt tokens per second (20.8 req/s) ran two workers'
    batches of 384-2K tokens up to 21 % slower per size than their fleet's (-1 to +21 % by size bin; at
    the planned requests per second -7 to +12 %), the gateway and both workers' HTTP sides sharing the
    cores (every fleet pessimistic in one of three runs)."""
    return scale_to_rate(earlier, planned.rate) if planned.rate else earlier


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    s = set_up(parser, parse(parser, argv, check_args), argv)
    write_outputs(s, make_plan(s, measure_speeds(s)))
    return 0


@dataclass
class Setup:
    """What a plan runs on, from its command line: the workload planned, the console, the engine's
    configuration and the cost model (`runner`), the policies and the simulated gateway's prefix key."""

    parser: argparse.ArgumentParser
    args: argparse.Namespace
    argv: list[str] | None
    w: Workload
    console: Console
    engine_cfg: EngineConfig
    runner: Runner
    policies: list[str]
    key_of: KeyOf | None


def parse(parser: argparse.ArgumentParser, argv: list[str] | None,
          *checks: Callable[[argparse.Namespace], str | None]) -> argparse.Namespace:
    """The command line, each of `checks` (what is wrong with it, or None) refused as one line, exit 2."""
    args = parser.parse_args(argv)
    for check in checks:
        if (problem := check(args)) is not None:
            parser.error(problem)
    return args


def set_up(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> Setup:
    """The workload (refused where it cannot be read or has under two requests) and the cost model."""
    try:
        w = load_workload(args)
    except (TraceError, ValueError) as exc:
        parser.error(str(exc))
    if len(w.requests) < 2:
        parser.error("the workload has fewer than two requests")
    console = results_console()
    if measured_cost(args.cost) and args.threads is None:  # an instance is what `serve --workers 1` starts here
        args.threads = one_worker_threads()
    try:
        engine_cfg = EngineConfig(prefix_caching=False, num_threads=args.threads)
        runner = Runner("sim", engine_cfg, args.cost)  # the cost model (cpu: this machine profiled)
    except ValueError as exc:
        parser.error(f"--cost {args.cost}: {exc}")
    # A trace that names no prompt blocks is routed by load alone: its prompts share nothing, so affinity
    # could only send each to its rendezvous home by the instances' names, a draw that is not the real
    # fleet's (at 2 instances 12 name pairs gave 81.5-97.5 %, 87.0 % on average; 87.5 % by load alone).
    routed_by_prefix = args.prefix_affinity_chars and any(r.prefix for r in w.requests)
    key_of = trace_key(args.prefix_affinity_chars, PREFIX_BLOCK_TOKENS) if routed_by_prefix else None
    return Setup(parser, args, argv, w, console, engine_cfg, runner, [x for x in args.policies.split(",") if x],
                 key_of)


def measure_speeds(s: Setup, fleets: Sequence[int] = ()) -> Speeds:
    """What each policy is planned at (`planning_costs`: a pilot, an engine pass, `--speed-from`, or the
    cost model as it is); `fleets`: the worker counts of real fleets that get pilots of their own shape."""
    try:
        return planning_costs(s.args, s.w, lambda: pilot_workload(s.args, s.w), s.runner.cost, s.runner.vocab,
                              s.engine_cfg, s.policies, s.console, fleets)
    except PilotError as exc:
        refuse_pilot(s.parser, exc)


def refuse_pilot(parser: argparse.ArgumentParser, exc: PilotError) -> NoReturn:
    """A pilot that gave no speed to plan at: one line, exit 2."""
    parser.error(f"--pilot: {exc} (--pilot 0 plans without one)")


def make_plan(s: Setup, speeds: Speeds) -> dict[str, Any]:
    """Each policy's smallest fleet at `speeds`, as plan.json says it."""
    args = s.args
    planner = Planner(s.w, s.runner.cost, s.engine_cfg, args.target, args.every_class, key_of=s.key_of,
                      poll_s=args.poll_s)
    started = time.perf_counter()
    results = plan_each(args, planner, with_headroom(args, speeds.planned, s.console), s.w, s.console)
    doc = document(args, f"{s.parser.prog} {' '.join(s.argv or [])}".strip(), s.w, s.runner.model_name, results,
                   time.perf_counter() - started, planner.sims)
    if speeds.key is not None:
        doc[speeds.key] = speeds.said
    if s.runner.profile_key is not None:  # what `--cost THIS/plan.json` plans with again
        doc["cost_profile"] = measured_profile(s.runner.cost) | {"key": s.runner.profile_key}
    return doc


def write_outputs(s: Setup, doc: dict[str, Any],
                  then: Callable[[Console, dict[str, Any], Path], list[Path]] | None = None) -> None:
    """plan.json and plan.png in `--out`, the plan's tables printed; `then` prints and draws what a
    caller adds (its files written are said with the plan's)."""
    out = Path(s.args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(doc, indent=2))
    print_tables(s.console, doc)
    plot(doc, out / "plan.png")
    wrote = [out / "plan.json", out / "plan.png", *(then(s.console, doc, out) if then else [])]
    s.console.print("wrote " + ", ".join(map(str, wrote)))


def with_headroom(args: argparse.Namespace, costs: dict[str, Planned], console: Console) -> dict[str, Planned]:
    """What each policy is planned with, every prefill `--headroom` longer."""
    if not args.headroom:
        return costs
    console.print(f"planning with {args.headroom:.0%} headroom: every prefill {1 + args.headroom:.2f}x as long")
    return {pol: p._replace(cost=replace(p.cost, scale=p.cost.scale * (1 + args.headroom))) for pol, p in costs.items()}


def plan_each(args: argparse.Namespace, planner: Planner, costs: dict[str, Planned], w: Workload, console: Console
              ) -> dict[str, dict[str, Any]]:
    """Per policy (in `costs`' order), its smallest fleet and every point tried, with progress shown."""
    results: dict[str, dict[str, Any]] = {}
    with Progress(console=console) as progress:
        task = progress.add_task("planning", total=len(costs))
        for pol, planned in costs.items():
            planner.use(planned)
            results[pol] = plan_policy(planner, pol, args.max_instances, lambda n, pol=pol: progress.update(
                task, description=f"{pol}: {n} instance(s) ({planner.sims} fleets simulated)"))
            results[pol]["cost_per_million_requests"] = cost_per_million(results[pol]["instances"], args.price, w)
            progress.advance(task)
    return results


def document(args: argparse.Namespace, command: str, w: Workload, model: str,
             results: dict[str, dict[str, Any]], elapsed_s: float, sims: int) -> dict[str, Any]:
    """plan.json: the workload, the question asked, and per policy its smallest fleet and every point."""
    fp = results.get("flowprefill", {}).get("instances")
    saved = {pol: r["instances"] - fp for pol, r in results.items()
             if pol != "flowprefill" and fp is not None and r["instances"] is not None}
    return {"workload": {"name": w.name, "source": w.source, "requests": len(w.requests), "class_rule": w.class_rule,
                         "rate": w.rate, "duration_s": w.duration_s},
            "cost_model": args.cost, "model": model, "target": args.target, "every_class": args.every_class,
            "headroom": args.headroom,
            "max_instances": args.max_instances, "price_per_instance_hour": args.price,
            "routing": {"poll_s": args.poll_s, "prefix_affinity_chars": args.prefix_affinity_chars,
                        "affinity_slack_s": DEFAULTS.prefix_affinity_slack_s},
            "policies": results, "instances_saved_by_flowprefill": saved,
            "planning_s": elapsed_s, "fleets_simulated": sims, "machine": machine_info(),
            "command": command}
