"""The sweep mode of `flowprefill bench peer`: start the contenders once, run each scenario's rate
sweep against all of them, write `peer-<scenario>-<dtype>.json` (goodput.json's schema, one "policy"
per contender, plus "peer") and a PNG per scenario, print the tables."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from engine.protocol.slo import DEFAULT_CLASSES, SLOClass, scaled
from loadtest import report
from loadtest.machine import cpu_count, machine_info
from loadtest.peer import summary
from loadtest.peer.client import Arrival, Target, arrivals, model_name, replay
from loadtest.peer.servers import Contender, Launch, Placement, SpecError, fleet
from loadtest.peer.setup import model_dir, placement
from loadtest.peer.sweep import SCENARIOS, Scenario, Sweep
from loadtest.workload import ClassRule, TraceError, Workload, head, named_or_trace


def floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values or any(v <= 0 for v in values):
        raise SpecError(f"{flag} {text!r}: expected numbers > 0")
    return values


def workload(args: argparse.Namespace) -> Workload:
    rule = ClassRule()
    try:
        base = named_or_trace(args.workload, rule)
    except (TraceError, OSError) as exc:
        raise SpecError(str(exc)) from None
    if args.requests < 1:
        raise SpecError("--requests must be >= 1")
    base = head(base, args.requests)
    longest = max(r.input_tokens for r in base.requests)
    if longest + args.max_tokens > args.max_model_len:  # else every server answers it 400, counted as a miss
        raise SpecError(f"--workload {args.workload}: a prompt of {longest} tokens and --max-tokens "
                        f"{args.max_tokens} do not fit --max-model-len {args.max_model_len}")
    return base


def scenarios(args: argparse.Namespace, where: Placement) -> list[Scenario]:
    """--scenarios as Scenarios. Before pin_load_generator: hogs roam every core this process may use."""
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not names or any(n not in SCENARIOS for n in names):
        raise SpecError(f"--scenarios {args.scenarios!r}: choose from {', '.join(SCENARIOS)}")
    if "hogs" in names and args.hogs < 1:
        raise SpecError(f"--hogs {args.hogs}: expected >= 1")
    every = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(range(cpu_count()))
    return [Scenario(n, every, 1.0, args.busy_period_ms, args.hogs) if n == "hogs"
            else Scenario(n, where.cores, args.busy_duty, args.busy_period_ms) for n in names]


def pin_load_generator(where: Placement) -> str:
    """This process (the client) onto the cores the servers do not use, where there are any."""
    if where.device != "cpu" or not hasattr(os, "sched_setaffinity"):
        return "unpinned"
    others = set(os.sched_getaffinity(0)) - set(where.cores)
    if not others:
        return "unpinned (no core left beside the servers')"
    os.sched_setaffinity(0, others)
    return f"cores {sorted(others)}"


def warm_up(targets: dict[str, Target]) -> None:
    """Three short requests each, one at a time: first-request costs (allocations, lazy imports) out
    of the first measured run."""
    warm = [Arrival(i, 0.3 * i, "standard", 512, [65 + i % 26] * 512) for i in range(3)]
    for target in targets.values():
        asyncio.run(replay(target, warm))


def sweep_classes(args: argparse.Namespace) -> dict[str, SLOClass]:
    """The SLO classes the sweep measures against: the defaults, their TTFT targets times --slo-scale."""
    return DEFAULT_CLASSES if args.slo_scale == 1 else scaled(DEFAULT_CLASSES, args.slo_scale)


def scenario_doc(args: argparse.Namespace, base: Workload, chosen: list[Contender], scenario: Scenario,
                 points: dict[str, list[dict[str, Any]]], context: dict[str, Any]) -> dict[str, Any]:
    classes = {k: {"ttft_ms": c.ttft_ms, "tbt_ms": c.tbt_ms} for k, c in sweep_classes(args).items()}
    doc = report.report(
        {"name": base.name, "source": base.source, "requests": len(base.requests), "class_rule": base.class_rule},
        "http", context["model"], args.slo_scale, classes, points,
        extra={"command": context["command"], "machine": context["machine"]})
    doc["peer"] = {"scenario": {"name": scenario.name, "describe": scenario.describe(), "duty": scenario.duty,
                                "period_ms": scenario.period_ms, "cores": list(scenario.cores),
                                "hogs": scenario.hogs},
                   "dtype": args.dtype, "max_tokens": args.max_tokens, **context["peer"]}
    doc["peer"] |= summary.comparison(doc, chosen, scenario.name)
    doc["ratios"] = doc["peer"]["ratios"]
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    return doc


def run(args: argparse.Namespace, chosen: list[Contender], versions: dict[str, str | None], console: Console) -> int:
    rates = floats(args.rates, "--rates")
    if args.repeats < 1:
        raise SpecError("--repeats must be >= 1")
    if not args.slo_scale > 0:
        raise SpecError(f"--slo-scale {args.slo_scale:g}: expected a number > 0")
    base, where = workload(args), placement(args)
    plan = scenarios(args, where)
    model = model_dir(args, console)
    launch = Launch(model, args.dtype, where, {k: getattr(args, f"{k}_python") for k in versions}, args.out / "logs",
                    max_model_len=args.max_model_len, gateway_concurrency=args.gateway_concurrency,
                    gateway_tokens=args.gateway_tokens)
    context: dict[str, Any] = {"command": "flowprefill bench peer " + " ".join(args.argv),
                               "machine": machine_info(), "model": model.name}
    context["peer"] = {"placement": where.describe(), "load_generator": pin_load_generator(where),
                       "versions": versions, "contenders": [c.name for c in chosen],
                       "gateway_concurrency": args.gateway_concurrency, "gateway_tokens": args.gateway_tokens,
                       "checkpoint": str(model)}
    with ExitStack() as servers:
        with console.status(f"starting {len(chosen)} contenders on {where.describe()} (vLLM takes minutes)…"):
            t0 = time.monotonic()
            urls = servers.enter_context(fleet(chosen, launch, args.start_timeout_s))
            context["peer"]["start_s"] = round(time.monotonic() - t0, 1)
            targets = {c.name: Target(urls[c.name], model_name(urls[c.name]),
                                      "lower_first" if c.sends_priority else None) for c in chosen}
            warm_up(targets)
        return _sweep(args, base, chosen, targets, plan, rates, context, console)


def _sweep(args: argparse.Namespace, base: Workload, chosen: list[Contender], targets: dict[str, Target],
           plan: list[Scenario], rates: list[float], context: dict[str, Any], console: Console) -> int:
    sweep = Sweep(targets, base, arrivals, args.max_tokens, args.drain_s, repeats=args.repeats,
                  classes=sweep_classes(args))
    args.out.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    docs = []
    for scenario in plan:
        name = scenario.name
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(name, total=len(rates) * len(targets) * args.repeats)

            def show(what: str, done: int, task: TaskID = task) -> None:
                progress.update(task, description=what, advance=done)
                if done and not console.is_terminal:  # a log file: a line per run instead of a live bar
                    console.print(f"done: {what}", highlight=False, soft_wrap=True)  # a line each, unbroken
                    console.file.flush()  # else a file's buffer held all 72 lines of a 33-minute sweep to its end

            points = sweep.run(rates, scenario, show)
        doc = scenario_doc(args, base, chosen, scenario, points, context)
        stem = args.out / f"peer-{name}-{args.dtype}"
        Path(f"{stem}.json").write_text(json.dumps(doc, indent=1))
        summary.plot(doc, Path(f"{stem}.png"))
        for table in (summary.summary_table(doc), summary.class_table(doc), summary.targets_table(doc)):
            console.print(table)
        console.print(f"wrote {stem}.json and {stem}.png")
        docs.append(doc)
    if len(docs) > 1:
        console.print(summary.scenarios_table(docs))
    return 0
