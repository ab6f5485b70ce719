"""`flowprefill bench planner`: the capacity planner (`flowprefill plan`) checked against real `flowprefill
serve` fleets on this machine.

It plans as `flowprefill plan` does, with every one of its options (engine/planner/command.py's steps), then
runs `flowprefill serve --workers N` for each N of `--against-serve` on the same arrivals (`--repeats R`
times, in rounds; with `--interleave-pilots` each fleet's pilot once per round, just before its real run,
the plan made at every round's pilot pooled) and compares each class's attainment with the simulated fleet's
(against_serve.py, paired.py, median.py).

Writes what `plan` writes, <out>/plan.json with the comparison added (`against_serve`,
`against_serve_agreement`, `pilots_interleaved`), each fleet's batch logs in <out>/batch-logs/, and with
paired rounds <out>/against-serve.png; prints the plan's tables, then the comparison and its verdict.
"""

from __future__ import annotations

import argparse

from engine.bench.planner_validation import against_serve
from engine.bench.planner_validation.against_serve import workers_of
from engine.bench.planner_validation.report import agreement, report
from engine.planner import command as plan
from engine.planner.speed import PilotError
from gateway.cli.common import Parser


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench planner", description=__doc__)
    plan.add_plan_options(p)
    p.add_argument("--against-serve", default=None, metavar="N,N",
                   help="required; cpu: run `flowprefill serve --workers N` on this machine for each N, on the plan's "
                        "arrivals, and compare its per-class attainment with the simulated fleet's")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="run each real fleet R times, in rounds, and compare with the median of its runs per class "
                        "(at one instance's knee two runs of the same fleet differed by 14.5 points on this 2-core "
                        "machine)")
    p.add_argument("--interleave-pilots", action="store_true",
                   help="with a pilot: run each fleet's pilot once per round of --repeats, just before its real run, "
                        "and plan at every round's pilot pooled, not at pilots run all before (on 2 shared cores the "
                        "speed moved a fifth between pilots and fleets minutes apart)")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the validation's own options (one line), or None; the plan's are `plan.check_args`.
    (`--against-serve` is required here, not by argparse, which would name it before an unknown option.)"""
    if args.against_serve is None:
        return "--against-serve N,N is required: the worker counts of the real fleets to compare with, e.g. 1,2"
    if args.repeats < 1:
        return "--repeats must be >= 1"
    if args.interleave_pilots and (not args.pilot or args.speed_from is not None or args.pilot_runs > 1):
        return ("--interleave-pilots runs a pilot in each round of --against-serve: it needs --pilot N, and takes "
                "neither --speed-from nor --pilot-runs (one pilot run per round)")
    if args.cost != "cpu":
        return "--against-serve compares with this machine's engine: use it with --cost cpu"
    try:
        workers_of(args.against_serve)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    s = plan.set_up(parser, plan.parse(parser, argv, plan.check_args, check_args), argv)
    args, rounds = s.args, None  # rounds: the real fleets' runs, where they ran before the plan (pilots between)
    if args.interleave_pilots:
        try:
            speeds, rounds = against_serve.interleaved_pilots(args, s.w, lambda: plan.pilot_workload(args, s.w),
                                                              s.runner.cost, s.policies, s.console)
        except PilotError as exc:
            plan.refuse_pilot(parser, exc)
    else:
        speeds = plan.measure_speeds(s, workers_of(args.against_serve))
    doc = plan.make_plan(s, speeds) | {"pilots_interleaved": args.interleave_pilots}
    own = speeds.key in ("pilot", "engine_pass")  # the planner's own prediction (not one learned from a run)
    if rounds is None:  # the real fleets have not run yet
        rounds = against_serve.real_rounds(args, s.w, s.policies, s.console)
    doc["against_serve"] = against_serve.compare_fleets(args, s.w, s.runner.cost, s.engine_cfg, rounds,
                                                         speeds if own else None)
    doc["against_serve_agreement"] = agreement(doc["against_serve"])
    plan.write_outputs(s, doc, report)
    return 0
