"""`flowprefill bench goodput`: max goodput per policy under heterogeneous TTFT SLOs.

Sweeps the offered rate (and the SLO scale at a fixed rate) of a workload per policy, on the real
engine in-process (virtual arrivals replayed against the wall clock) or in the simulator driving
the same scheduler code. As in the paper, the measured instance is a prefill instance
(PD disaggregation): each request generates its first token and is done.

Writes <out>/goodput-<engine>.json (the goodput.json schema of docs/reference.md, one file per engine so
that real and simulated runs sit side by side), <out>/goodput-<engine>.png, and prints the table. A max
goodput of "below R" means no rate swept, down to the lowest R, reached 90 % attainment.
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from engine.core import batch_log
from engine.core.config import KV_AUTO_TOKENS, EngineConfig
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import make_policy
from engine.model.cost import OpCost
from engine.protocol.slo import DEFAULT_CLASSES, SLOClass
from engine.sim import SimConfig, simulate
from engine.sim.errors import DEFAULT_LEVELS, PredictionError
from engine.sim.oracle import BatchCostRecorder, ExactCosts
from engine.sim.simulator import BatchRecord
from gateway.cli.common import CommandLineError, Parser
from gateway.cli.console import results_console
from gateway.cli.options import add_engine_options, check_model, engine_config
from loadtest import goodput_report, report
from loadtest.goodput_errors import levels_of, sweep_errors
from loadtest.goodput_report import IDEAL
from loadtest.machine import machine_info
from loadtest.workload import (
    PREFIX_BLOCK_TOKENS,
    ClassRule,
    Workload,
    head,
    named_or_trace,
    prefixed_prompt,
    scale_to_rate,
    synthesize_prompt,
)

DEFAULT_POLICIES = "flowprefill,fcfs,chunked:2048,chunked:8192"
RATIO_PAIRS = [("flowprefill", "fcfs"), ("flowprefill", "chunked:2048"), ("flowprefill", "chunked:8192"),
               ("flowprefill", "flowprefill-ideal")]


def make_requests(w: Workload, classes: dict[str, SLOClass], slo_scale: float, t0: float,
                  vocab: int | None, max_tokens: int = 1) -> list[Request]:
    """The workload's requests, answering as many tokens as the trace says, at most `max_tokens` (1: the
    first token alone), never ending early (an end of sequence ignored: a simulated answer has none)."""
    out = []
    zeros: dict[int, list[int]] = {}  # simulated prompts: only their length counts, and they are never changed
    for i, tr in enumerate(w.requests):
        c = classes[tr.slo_class]
        n = tr.input_tokens
        if vocab:  # a trace naming its prompts' blocks shares them (the engine's prefix cache finds them)
            ids = prefixed_prompt(tr.prefix, n, vocab) if tr.prefix else synthesize_prompt(n, vocab, seed=i)
        else:
            ids = zeros.get(n) or zeros.setdefault(n, [0] * n)
        answer = max(1, min(tr.output_tokens, max_tokens))
        r = Request.for_class(c, request_id=f"w{i}", prompt_token_ids=ids, arrival_time=t0 + tr.arrival_s,
                              sampling=SamplingParams(max_tokens=answer, ignore_eos=answer > 1))
        r.ttft_target_s *= slo_scale
        r.late_s *= slo_scale
        r.deadline = r.arrival_time + r.ttft_target_s
        if tr.prefix and not vocab:  # simulated: the trace's hash ids name its blocks (SimConfig.prefix_caching)
            r.block_hashes = [h.to_bytes(8, "little", signed=True) for h in tr.prefix]
        out.append(r)
    return out


def sim_config(engine_cfg: EngineConfig, ideal: bool = False, error: PredictionError | None = None,
               seed: int = 0) -> SimConfig:
    """The simulator set up as the engine `engine_cfg` describes (its step budget, batch bound, KV, late share)."""
    budget = engine_cfg.step_budget_ms / 1000 if engine_cfg.preemptible else None
    return SimConfig(step_budget_s=budget, max_batch_tokens=engine_cfg.max_batch_tokens,
                     kv_capacity_tokens=engine_cfg.kv_capacity_tokens or KV_AUTO_TOKENS,
                     kv_block_size=engine_cfg.kv_block_size,
                     kv_reservation=engine_cfg.kv_reservation, prefix_caching=engine_cfg.prefix_caching, ideal=ideal,
                     late_share=engine_cfg.late_share, error=error or PredictionError(), seed=seed)


def outcomes(reqs: list[Request]) -> list[report.Outcome]:
    return [report.Outcome(r.slo_class, r.ttft_target_s, r.ttft) for r in reqs]


def measured_cost(cost_name: str) -> bool:
    """Whether `--cost` names a measured CPU profile: this machine's (cpu) or one stored in a .json file
    (engine/model/calibration.py's read_profile), not a roofline (MODEL@GPU)."""
    return cost_name == "cpu" or cost_name.lower().endswith(".json")


class Runner:
    """Runs one (policy, workload, slo scale) point on the real engine or the simulator."""

    def __init__(self, kind: str, engine_cfg: EngineConfig, cost_name: str, max_tokens: int = 1) -> None:
        self.kind, self.engine_cfg, self.max_tokens = kind, engine_cfg, max_tokens
        self._engines: dict[str, Any] = {}
        self._ideal: dict[tuple[float, float], dict[str, Any]] = {}  # (rate, slo scale) -> bound point
        self.profile_key: str | None = None  # the measured profile's (engine/model/calibration.py), not a roofline's
        if kind == "real" or measured_cost(cost_name):
            from engine.core.engine import Engine, release_memory
            from engine.model.calibration import profile_key, read_profile

            # the cost model profiled on this machine; a simulation reads the cached profile as it
            # stands (at 3 req/s the same simulation gave 90.4 % and 83.2 % in two runs a minute
            # apart, each start-up's calibration having moved the median); engines add theirs to it.
            # A .json: the profile stored there (a plan.json's, another machine's cache file), read
            # before the model loads so that a wrong file is said at once.
            stored = read_profile(Path(cost_name)) if kind == "sim" and cost_name != "cpu" else None
            probe = Engine(engine_cfg, policy="fcfs", record_profile=kind == "real", profile=stored)
            self.cost: OpCost = probe.cost
            self.model_name, self.vocab = probe.model.cfg.name, probe.model.cfg.vocab_size
            self.profile_key = profile_key(probe.model)
            del probe
            release_memory()
        else:
            from engine.sim.costs import analytical

            model, _, gpu = cost_name.partition("@")
            self.cost = analytical(model, gpu)
            self.model_name, self.vocab = f"{model} on {gpu} (analytical)", None

    def sim(self, policy: str, w: Workload, classes: dict[str, SLOClass], scale: float,
            cost: OpCost | None = None, exact: ExactCosts | None = None,
            error: PredictionError | None = None, seed: int = 0, batches: list[BatchRecord] | None = None
            ) -> dict[str, Any]:
        reqs = make_requests(w, classes, scale, 0.0, None, self.max_tokens)
        name = "flowprefill" if policy == IDEAL else policy
        cfg = sim_config(self.engine_cfg, ideal=policy == IDEAL, error=error, seed=seed)
        if cfg.prefix_caching and any(tr.prefix for tr in w.requests):  # its KV blocks are those the ids name
            cfg = replace(cfg, kv_block_size=PREFIX_BLOCK_TOKENS)
        pre = simulate(reqs, make_policy(name), cost or self.cost, cfg, exact=exact, batches=batches)
        return report.point(w.rate, outcomes(reqs), pre)

    def real(self, policy: str, w: Workload, classes: dict[str, SLOClass], scale: float) -> dict[str, Any]:
        from engine.core.engine import Engine

        if policy not in self._engines:
            engine = Engine(self.engine_cfg, policy=policy)
            engine.cost = engine.scheduler.cost = self.cost  # one calibration for every policy
            engine.observers.append(BatchCostRecorder())
            batch_log.attach(engine, policy.replace(":", "") + "-")  # with $FLOWPREFILL_BATCH_LOG: a diagnostic
            self._engines[policy] = engine.start()
        engine = self._engines[policy]
        measured = next(o for o in engine.observers if isinstance(o, BatchCostRecorder))
        measured.batches.clear()
        start_preemptions = engine.preemptions
        # The simulator's twin of this point starts from the cost model as the engine starts it, and
        # corrects it online as the engine does (the engine thread goes on correcting its own).
        snapshot = copy.deepcopy(self.cost)
        t0 = time.monotonic() + 0.5
        reqs = make_requests(w, classes, scale, t0, self.vocab, self.max_tokens)
        remaining = threading.Semaphore(0)
        for r in reqs:
            r.sink = lambda out: out.finish_reason and remaining.release()
        for r in reqs:
            delay = r.arrival_time - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            engine.add_request(r)
        deadline = time.monotonic() + 120
        for r in reqs:
            if not remaining.acquire(timeout=max(0.0, deadline - time.monotonic())):
                engine.cancel(r.request_id)  # counted as a miss: nothing is dropped silently
        while any(engine.has_request(r.request_id) for r in reqs) and time.monotonic() < deadline + 30:
            time.sleep(0.01)  # the cancels are the engine thread's to carry out: the next point reuses the ids
        pt = report.point(w.rate, outcomes(reqs), engine.preemptions - start_preemptions)
        pt["host_gap_ms"] = batch_log.host_gaps_ms(measured.batches)  # the device idle between batches
        # The simulator's twins of this very point: with the cost model as the engine began it, and
        # with the costs each batch measured (what is left is the simulator's mechanics: the same
        # decisions, or not).
        pt["sim_attainment"] = self.sim(policy, w, classes, scale, snapshot)["attainment"]
        exact = ExactCosts.from_batches(self.cost, measured.batches)
        pt["sim_exact_attainment"] = self.sim(policy, w, classes, scale, exact=exact)["attainment"]
        if policy == "flowprefill":  # the ideal-preemption bound: the same arrivals, the costs measured here
            self._ideal[(round(w.rate, 6), scale)] = self.sim(IDEAL, w, classes, scale, exact=exact)
        return pt

    def run(self, policy: str, w: Workload, classes: dict[str, SLOClass], scale: float) -> dict[str, Any]:
        if policy == IDEAL and (pt := self._ideal.get((round(w.rate, 6), scale))):
            return pt
        if self.kind == "sim" or policy == IDEAL:
            return self.sim(policy, w, classes, scale)
        return self.real(policy, w, classes, scale)

    def close(self) -> None:
        for e in self._engines.values():
            e.shutdown()


def _scale_needed(points: list[dict[str, Any]]) -> float | None:
    """Tightest SLO scale (smallest) at which attainment is still >= the target."""
    ok = [p["slo_scale"] for p in points if p["attainment"] >= report.ATTAINMENT_TARGET]
    return min(ok) if ok else None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowprefill bench goodput", description=__doc__)  # a mistake: one line, exit 2
    p.add_argument("--engine", choices=["real", "sim"], default="sim",
                   help="real: the engine in this process on this machine; sim: the simulator driving the "
                        "same scheduler code with a cost model (--cost) (default: sim)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy names")
    p.add_argument("--workload", default="azure-mix",
                   help="azure-mix, long-mix, mooncake-4k or a trace file (Azure/BurstGPT CSV, JSONL)")
    p.add_argument("--requests", type=int, default=None, help="first N requests of the workload")
    p.add_argument("--rates", default=None, help="offered rates, req/s (default: per engine)")
    p.add_argument("--slo-scales", default="0.4,0.6,0.8,1.0,1.5,2.0",
                   help="comma-separated SLO scales for the sweep at --scale-rate; empty: no sweep "
                        "(default: 0.4,0.6,0.8,1.0,1.5,2.0)")
    p.add_argument("--scale-rate", type=float, default=None, help="rate for the SLO-scale sweep (default 2)")
    p.add_argument("--cost", default="cpu", help="sim cost model: cpu (profile this machine), MODEL@GPU, e.g. "
                   "llama-3.1-8b@h100, or FILE.json: the CPU profile stored there (a plan.json's cost_profile, "
                   "an engine's opcost-*.json cache file)")
    p.add_argument("--host-ms", type=float, default=None,
                   help="sim: the host's time per batch outside its steps, ms (OpCost.batch_host_s: sampling, "
                        "finishing, the next decision); 0 models it overlapped with the device, as asynchronous "
                        "scheduling would (default: the cost model's, 3.8 for MODEL@GPU)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="each request answers as many tokens as its trace says, at most this many; the engine "
                        "(and the simulator) decode them between prefill steps (default: 1, the first token alone)")
    p.add_argument("--no-ideal", action="store_true", help="skip the ideal-preemption bound")
    p.add_argument("--errors", nargs="?", const=DEFAULT_LEVELS, default=None, metavar="LEVELS",
                   help="sim: sweep the rates once per injected prediction error instead (comma-separated: "
                        f"none, noise:SIGMA, bias:FACTOR, slowdown:FACTOR[@FRACTION]; alone: {DEFAULT_LEVELS})")
    p.add_argument("--convergence-rate", type=float, default=None, metavar="R",
                   help="--errors with a slowdown level: the rate at which FlowPrefill's correction is followed "
                        "batch by batch after the step (default: the lowest of --rates)")
    p.add_argument("--seeds", type=int, default=1,
                   help="--errors: simulate each point of a noisy level with this many seeds and report the "
                        "median of each number (one run of one seed is one draw of the noise)")
    p.add_argument("--out", default="bench-results",
                   help="directory for goodput-ENGINE.json and .png (default: bench-results)")
    add_engine_options(p)  # --model, --device, --dtype ...: the real engine's, and the simulator's settings
    # Off unless asked: the traces give token counts only, and the same synthesized prompts run for every
    # policy and rate, so a cache would make each later run look faster than it is.
    p.set_defaults(prefix_caching=False)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_model(args.model)
    except CommandLineError as exc:
        parser.error(str(exc))  # one line, exit 2
    engine_cfg = engine_config(args)

    console = results_console()
    real = args.engine == "real"
    n = args.requests or (100 if real else 1000)
    rates = [float(x) for x in (args.rates or "1,2,3,4,6,8,10,12,14,16").split(",")]
    scales = [float(x) for x in args.slo_scales.split(",") if x]  # empty: no SLO-scale sweep
    policies = [x for x in args.policies.split(",") if x]
    for name in policies:
        make_policy(name)  # reject bad names before any work
    if real and args.cost != "cpu":
        parser.error(f"--cost {args.cost}: the simulator's cost model; --engine real predicts with its own profile")
    if real and args.host_ms is not None:
        parser.error("--host-ms: the simulator's; --engine real measures its own host time")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: at least 1")
    if args.host_ms is not None and args.host_ms < 0:
        parser.error(f"--host-ms {args.host_ms:g}: a time, 0 or more")
    if args.errors is not None:
        try:
            levels = levels_of(args)
        except ValueError as exc:
            parser.error(str(exc))  # one line, exit 2
    try:
        runner = Runner("sim" if args.errors is not None else args.engine, engine_cfg, args.cost, args.max_tokens)
    except ValueError as exc:
        parser.error(f"--cost {args.cost}: {exc}")  # one line, exit 2
    if args.host_ms is not None:
        runner.cost = replace(runner.cost, batch_host_s=args.host_ms / 1000)
    if args.max_tokens > 1 and not runner.cost.decode_s:
        console.print("warning: this cost model times no decode step (a GPU's profile, or one calibrated before "
                      "decode was): simulated answers take no time")
    if args.errors is not None:
        return sweep_errors(args, console, levels, policies, rates, n, argv, runner)
    if not args.no_ideal and "flowprefill" in policies:
        policies.append(IDEAL)
    rule = ClassRule()
    base = named_or_trace(args.workload, rule)
    base = head(base, n)
    classes = DEFAULT_CLASSES
    scale_rate = args.scale_rate or 2.0
    try:
        results, scale_results = _sweep(runner, console, policies, base, classes, rates, scales, scale_rate)
    finally:
        runner.close()

    doc = _document(args, argv, runner, base, classes, results, scale_results, scale_rate)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"goodput-{args.engine}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2))
    goodput_report.table(console, doc)
    goodput_report.plot(doc, out / f"{stem}.png")
    console.print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


def _document(args: argparse.Namespace, argv: list[str] | None, runner: Runner, base: Workload,
              classes: dict[str, SLOClass], results: dict[str, list[dict[str, Any]]],
              scale_results: dict[str, list[dict[str, Any]]], scale_rate: float) -> dict[str, Any]:
    """The goodput.json document of a sweep (docs/reference.md's schema), its ratios included."""
    scale_needed = {pol: _scale_needed(pts) for pol, pts in scale_results.items()}
    doc = report.report(
        {"name": base.name, "source": base.source, "requests": len(base.requests), "class_rule": base.class_rule},
        args.engine, runner.model_name, 1.0,
        {k: {"ttft_ms": c.ttft_ms, "tbt_ms": c.tbt_ms} for k, c in classes.items()},
        results, RATIO_PAIRS,
        extra={"slo_scale_sweep": {"rate": scale_rate, "policies": scale_results,
                                   "tightest_scale_at_target": scale_needed},
               "cost_model": args.cost if args.engine == "sim" else "cpu (measured)",
               "max_tokens": args.max_tokens,
               "machine": machine_info(),
               "command": "flowprefill bench goodput " + " ".join(argv or [])})
    fp, sn = scale_needed.get("flowprefill"), scale_needed
    for base_pol in ("chunked:2048", "chunked:8192"):
        if fp and sn.get(base_pol):
            doc["ratios"][f"slo_scale {base_pol}/flowprefill"] = sn[base_pol] / fp
    return doc


def _sweep(runner: Runner, console: Console, policies: list[str], base: Workload, classes: dict[str, SLOClass],
           rates: list[float], scales: list[float], scale_rate: float
           ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Each policy over the rates (at SLO scale 1, up to where it collapsed), then over the SLO scales at
    `scale_rate`: the points of each."""
    results: dict[str, list[dict[str, Any]]] = {pol: [] for pol in policies}
    scale_results: dict[str, list[dict[str, Any]]] = {pol: [] for pol in policies}
    with Progress(console=console) as progress:
        task = progress.add_task("goodput sweep", total=len(policies) * (len(rates) + len(scales)))
        for pol in policies:
            for rate in rates:
                progress.advance(task)
                if report.collapsed(results[pol]):
                    continue  # far past its knee: higher rates only cost time
                progress.update(task, description=f"{pol} @ {rate:g} req/s")
                results[pol].append(runner.run(pol, scale_to_rate(base, rate), classes, 1.0))
            for scale in scales:
                progress.update(task, description=f"{pol} @ SLO scale {scale:g}")
                pt = runner.run(pol, scale_to_rate(base, scale_rate), classes, scale)
                scale_results[pol].append(pt | {"slo_scale": scale})
                progress.advance(task)
    return results, scale_results
