"""FlowPrefill: SLO-aware LLM serving (an SLO gateway in front of engine workers that preempt
prefills at operator boundaries), its load test and its benchmarks.

A thin dispatcher: each subcommand's module is imported only when it runs, so `flowprefill --help`
and `flowprefill gateway` load no torch."""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from types import ModuleType

from gateway.cli.common import CommandLineError, Parser, require_extras


@dataclass(frozen=True)
class Command:
    """A subcommand: `module` defines `add_arguments(parser)` and `run(args) -> int`, or, for the
    load test and the benchmarks, which parse their own arguments, `main(argv) -> int`."""

    module: str
    help: str
    extras: tuple[str, ...] = ()  # the install's extras it needs (pyproject.toml): checked before it runs

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


ENGINE, BENCH = ("engine",), ("engine", "loadtest")  # the benchmarks start engines and plot
SERVERS = {
    "serve": Command("gateway.cli.serve", "gateway + engine worker(s) on this machine (SmolLM2-135M by default)",
                     ENGINE),
    "gateway": Command("gateway.cli.gateway", "the SLO gateway alone, in front of running workers"),
    "worker": Command("gateway.cli.worker", "one engine worker (OpenAI API + /load, /health, /metrics)", ENGINE),
    "epp": Command("gateway.cli.epp", "the SLO routing as an endpoint picker for Envoy-based gateways (Kubernetes "
                   "Gateway API Inference Extension; the epp extra)", ("epp",)),
}
# `flowprefill bench NAME ARGS`: adding a benchmark is one line here.
BENCHES = {
    "prefill": Command("engine.bench.prefill", "prefill throughput, checkpoint overhead, preemption stop latency",
                       BENCH),
    "goodput": Command("loadtest.goodput", "max goodput per policy vs rate and SLO scale (real engine or sim)",
                       BENCH),
    "gateway": Command("gateway.bench", "latency the gateway adds and its requests/s on one core", BENCH),
    "epp": Command("gateway.epp.bench", "latency the endpoint picker adds, its picks/s on one core, DNS join/leave",
                   ("epp",)),
    "prefix": Command("engine.bench.prefix_cache",
                      "prefix caching on a multi-turn chat workload: TTFT per turn, on vs off", BENCH),
    "decode": Command("engine.bench.decode", "decode step time by answers at once and context, per attention backend "
                      "(the paged KV read in place vs gathered)", BENCH),
    "kv": Command("engine.bench.kv_growth",
                  "KV taken as answers grow vs reserved up front, on chat requests of a trace", BENCH),
    "health": Command("engine.bench.health", "GET /health latency while a burst of requests arrives (the "
                      "event loop never waits on scheduling)", BENCH),
    "planner": Command("engine.bench.planner_validation.command", "the capacity planner against real serve fleets "
                       "on this machine: `plan`, then `serve --workers N` on the same arrivals", BENCH),
    "peer": Command("loadtest.peer.cli", "FlowPrefill next to vLLM / SGLang on this machine: goodput sweep or raw "
                    "TTFT", BENCH),
}
LOADTEST = Command("loadtest.run", "a Locust profile, headless, against a gateway: per-class goodput report",
                   ("loadtest",))
# Top-level tools that parse their own arguments, as the benchmarks do.
TOOLS = {
    "loadtest": LOADTEST,
    "plan": Command("engine.planner.command", "capacity planner: the instances a workload needs per policy to meet an "
                    "SLO attainment target (simulated behind the gateway's routing)", BENCH),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("flowprefill")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(only: str | None = None) -> Parser:
    """The command tree. `only`: build that server subcommand's options and no other's (what `main`
    does, so a subcommand imports only its own module); None: every subcommand's (for tools, tests)."""
    parser = Parser(prog="flowprefill", description=__doc__.split("\n\n")[0],
                    epilog="`flowprefill COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SERVERS.items():
        if only in (None, name):
            module = command.load()
            module.add_arguments(sub.add_parser(name, help=command.help, description=module.__doc__))
        else:
            sub.add_parser(name, help=command.help, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks; `flowprefill bench NAME --help` "
                           "describes each.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, command in BENCHES.items():
        benches.add_parser(name, help=command.help, add_help=False)  # its own parser reads the rest
    for name, command in TOOLS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def _run_tool(tool: Command, rest: list[str]) -> int:
    """A benchmark or tool, once the extras it needs are there; its `--help` without them where its
    module imports without them (its parser is what describes it), else the extra it needs."""
    if "-h" in rest or "--help" in rest:
        try:
            module = tool.load()
        except ImportError:
            require_extras(tool.extras)
            raise
        return module.main(rest)
    require_extras(tool.extras)
    return tool.load().main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll is noise
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in SERVERS else "")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command in SERVERS:
            if rest:
                parser.error(f"unrecognized arguments to {args.command}: {' '.join(rest)} "
                             f"(see flowprefill {args.command} --help)")
            require_extras(SERVERS[args.command].extras)
            return SERVERS[args.command].load().run(args)
        tool = BENCHES[args.bench] if args.command == "bench" else TOOLS[args.command]
        return _run_tool(tool, rest)
    except CommandLineError as exc:
        print(f"flowprefill {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except KeyboardInterrupt:
        return 130
