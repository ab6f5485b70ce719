"""The layers point down: protocol ← engine core ← serving ← gateway and the command line.

- `engine/protocol/` imports nothing but the standard library and msgspec;
- the engine core (KV cache, prefill, decode, sampling, scheduler and policies, model, predictor,
  simulator) imports nothing of the serving layer (the worker's HTTP server, the OpenAI answers, tool
  calls, reasoning, structured output, the KV hand-off's transport);
- the gateway imports no torch, numpy, tokenizers, locust or matplotlib, and of the engine only its
  protocol; telemetry, which the gateway uses too, only the engine's torch-free observer interface.

A static check of every import statement (`forbidden_imports`, also run on an older tree to count what
there was), and the same seen from a running process: what importing the gateway or parsing `serve`'s
command line loads, and what the `flowprefill serve` process itself maps while its workers run."""

from __future__ import annotations

import ast
import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import HEAVY, free_port, mapped_heavy, needs_engine, start, stop, wait_healthy

pytestmark = pytest.mark.gateway_only

ROOT = Path(__file__).resolve().parents[1]
HTTP = ("httpx", "httpcore", "litestar", "uvicorn")  # the serving layer's, and the gateway's
# A layer is a folder (fnmatch's `*` crosses folders: engine/core/*.py takes engine/core/scheduler/ too).
PROTOCOL = ("engine/protocol/*.py",)
CORE = ("engine/core/*.py", "engine/model/*.py", "engine/attention/*.py", "engine/sim/*.py")
SERVING = ("engine/serving/*.py",)
# Benchmarks: the top, like the CLI.
BENCH = ("engine/bench/*.py", "engine/__init__.py", "gateway/bench.py", "gateway/epp/bench*.py")
# The capacity planner (`flowprefill plan`): above the engine and the gateway whose routing it simulates, below
# the benchmarks. Its validation against real runs is a benchmark (`flowprefill bench planner`,
# engine/bench/planner_validation/) that builds on it: the planner, its command too, imports nothing of the
# benchmarks (the console and machine description it shares with them are gateway/cli/ and loadtest/'s).
PLANNER = ("engine/planner/*.py",)
SERVING_MODULES = ("engine.serving",)
# What the gateway's processes may load of the engine: its protocol, and through telemetry the observer
# interface (engine/core/observer.py: no imports at run time; engine/core/__init__.py imports nothing);
# `serve` also reads the engine's options and the output parsers' names, all torch-free.
GATEWAY_ENGINE = ("engine", "engine.protocol", "engine.protocol.*", "engine.core", "engine.core.observer")
SERVE_ENGINE = (*GATEWAY_ENGINE, "engine.core.config", "engine.core.text", "engine.core.cpu_affinity",
                "engine.serving", "engine.serving.reasoning", "engine.serving.tool_calls")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _imports(tree: ast.Module) -> list[tuple[int, str, bool]]:
    """Every module imported: (line, name, at module level), `if TYPE_CHECKING:` blocks left out."""
    out: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other, top)
                continue
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child.lineno, child.module, top))
                out.extend((child.lineno, f"{child.module}.{a.name}", top) for a in child.names)
            visit(child, top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(tree, True)
    return out


def _rule(path: str, module: str, top: bool) -> str | None:
    """Why `path` may not import `module` (None: it may)."""
    root = module.split(".")[0]
    if (module == "engine.planner" or module.startswith("engine.planner.")) and not _matches(path, PLANNER + BENCH):
        return "only the benchmarks import the capacity planner (the command line runs it by its module's name)"
    if _matches(path, PLANNER):
        if module == "engine.bench" or module.startswith("engine.bench."):
            return "the planner imports nothing of the benchmarks (its validation, a benchmark, builds on it)"
    elif _matches(path, PROTOCOL):
        if root not in sys.stdlib_module_names and root != "msgspec" and not module.startswith("engine.protocol"):
            return "the protocol imports only the standard library and msgspec"
    elif _matches(path, CORE):
        if any(module == m or module.startswith(f"{m}.") for m in SERVING_MODULES) or root in HTTP:
            return "the engine core imports nothing of the serving layer (nor HTTP)"
    elif path.startswith("gateway/cli/"):  # the dispatcher imports a subcommand's engine only when it runs
        if top and (root in HEAVY
                    or (root == "engine" and not _matches(module, (*SERVE_ENGINE, "engine.core.config.*")))):
            return "the command line loads no engine (torch) before a subcommand runs one"
    elif path.startswith("gateway/") and not _matches(path, BENCH):
        if root in HEAVY or (root == "engine" and not module.startswith("engine.protocol")):
            return "the gateway imports no torch, numpy, tokenizers, locust or matplotlib, and only engine.protocol"
    elif path.startswith("telemetry/") and top and (
            root in HEAVY or (root == "engine" and not module.startswith(("engine.core.observer", "engine.protocol")))):
            return "telemetry, which the gateway loads, imports only the engine's observer interface"
    return None


def forbidden_imports(root: Path) -> list[str]:
    """Each import that breaks a layer rule, as `path:line: module (the rule)`. An engine module
    outside a layer's folder is one too (engine/ itself holds only its `__init__.py`): a new module has
    to say where it belongs."""
    found = []
    for file in sorted([*root.glob("engine/**/*.py"), *root.glob("gateway/**/*.py"), *root.glob("telemetry/*.py"),
                       *root.glob("loadtest/**/*.py")]):
        path = file.relative_to(root).as_posix()
        if path.startswith("engine/") and not _matches(path, PROTOCOL + CORE + SERVING + PLANNER + BENCH):
            found.append(f"{path}: in no layer (put it in a layer's folder)")
            continue
        lines = set()  # one finding per import statement
        for line, module, top in _imports(ast.parse(file.read_text(encoding="utf-8"))):
            if line not in lines and (why := _rule(path, module, top)) is not None:
                lines.add(line)
                found.append(f"{path}:{line}: {module} ({why})")
    return found


def test_no_import_breaks_a_layer() -> None:
    found = forbidden_imports(ROOT)
    assert not found, f"{len(found)} forbidden import(s):\n" + "\n".join(found)


def test_the_check_finds_a_forbidden_import(tmp_path: Path) -> None:
    """The rules catch what they are for (a check that cannot fail guards nothing)."""
    for path, line in (("engine/core/decode.py", "from engine.serving.reasoning import CLOSE"),
                       ("engine/core/scheduler/new.py", "from engine.serving import worker"),
                       ("gateway/app.py", "import torch"),
                       ("gateway/routing.py", "from engine.core.request import Request"),
                       ("engine/protocol/slo.py", "import numpy"), ("engine/newcore.py", "import os"),
                       ("loadtest/goodput.py", "from engine.planner.fleet import Planner"),
                       ("engine/planner/fleet.py", "from engine.bench.planner_validation import median"),
                       ("engine/planner/command.py", "from engine.bench.planner_validation import against_serve")):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(f"def f():\n    {line}\n")
    found = forbidden_imports(tmp_path)
    assert len(found) == 9 and "engine/newcore.py: in no layer (put it in a layer's folder)" in found, found


# Import cycles (module level and inside functions, `if TYPE_CHECKING:` left out). Each one left is listed
# here with why it stays: the list can only shrink (an entry no longer a cycle fails the test too).
ALLOWED_CYCLES: dict[frozenset[str], str] = {}
PACKAGES = ("engine", "gateway", "loadtest", "telemetry")


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each first-party module and the first-party modules its import statements name (`from a import b`
    names the module `a.b` where there is one, else `a`)."""
    files = {}
    for pkg in PACKAGES:
        for file in sorted((root / pkg).glob("**/*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, file in files.items():
        named = (resolve(name) for _, name, _ in _imports(ast.parse(file.read_text(encoding="utf-8"))))
        graph[module] = {m for m in named if m is not None and m != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's, iterative): each is
    one knot of modules that import each other, directly or around a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root_module in sorted(graph):
        if root_module in index:
            continue
        work = [(root_module, iter(sorted(graph[root_module])))]
        index[root_module] = low[root_module] = len(index)
        stack.append(root_module)
        on_stack.add(root_module)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    knot = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        knot.add(member)
                        if member == node:
                            break
                    if len(knot) > 1:
                        found.append(frozenset(knot))
    return found


def cycle_path(graph: dict[str, set[str]], knot: frozenset[str]) -> str:
    """One loop through `knot`, as `a -> b -> a`, for the failure message."""
    first = min(knot)
    paths = {first: [first]}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & knot):
            if nxt == first:
                return " -> ".join([*paths[node], first])
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return " -> ".join(sorted(knot))


def test_no_import_cycles() -> None:
    """No modules import each other (a loop of imports, module level or inside a function), but the
    allowed ones; and each allowed one is still there (fixed: take it off the list)."""
    graph = module_graph(ROOT)
    cycles = import_cycles(graph)
    new = [cycle_path(graph, c) for c in cycles if c not in ALLOWED_CYCLES]
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in cycles]
    assert not new, f"{len(new)} import cycle(s):\n" + "\n".join(new)
    assert not gone, f"no longer cycles, take them off ALLOWED_CYCLES: {gone}"


def test_the_check_finds_an_import_cycle(tmp_path: Path) -> None:
    """A cycle hidden in a function is found, and named."""
    for path, text in (("engine/a.py", "from engine.b import x\n"),
                       ("engine/b.py", "def f():\n    from engine import a\n"),
                       ("engine/c.py", "from engine import a\n")):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    graph = module_graph(tmp_path)
    assert import_cycles(graph) == [frozenset({"engine.a", "engine.b"})]
    assert cycle_path(graph, frozenset({"engine.a", "engine.b"})) == "engine.a -> engine.b -> engine.a"


def _loaded(code: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _offenders(modules: list[str], engine_allowed: tuple[str, ...]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY or (m.split(".")[0] == "engine"
                                                                and not _matches(m, engine_allowed))]


def test_the_gateway_loads_no_engine() -> None:
    """What `flowprefill gateway` imports, its app built with tracing and metrics."""
    modules = _loaded("from gateway.cli import build_parser\n"
                      "args = build_parser(only='gateway').parse_args(['gateway', '--workers', 'http://127.0.0.1:9'])\n"
                      "import gateway.cli.gateway, telemetry.tracing\n"
                      "from gateway.app import create_gateway_app\n"
                      "from gateway.config import GatewayConfig\n"
                      "create_gateway_app(GatewayConfig(workers=['http://127.0.0.1:9']))")
    assert "gateway.app" in modules and "telemetry.metrics" in modules
    assert not _offenders(modules, GATEWAY_ENGINE)


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_parsing_serve_and_worker_loads_no_engine(command: str) -> None:
    """`serve` runs the gateway in its own process and the engine only in its workers' (child
    processes): its command line, the workers' options it passes on, its fleet's plan, load no torch;
    nor does `worker --help`."""
    modules = _loaded("from gateway.cli import build_parser\n"
                      f"args = build_parser(only={command!r}).parse_args([{command!r}, '--policy', 'chunked:512:fcfs',"
                      " '--tool-call-parser', 'hermes', '--reasoning-parser', 'qwen3'])\n"
                      "from gateway.cli.options import to_argv, worker_options\n"
                      "to_argv(args, worker_options())\n"
                      "import gateway.cli.serve, gateway.cli.gateway, gateway.app\n")
    assert "gateway.cli.options" in modules and not _offenders(modules, SERVE_ENGINE)


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:  # it ended meanwhile
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


@needs_engine
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_the_serve_process_maps_no_torch() -> None:
    """A running `flowprefill serve`: its workers map torch, the serve process itself (the gateway) not."""
    port = free_port(span=2)
    proc = start("serve", "--model", "tiny", "--port", str(port), "--kv-capacity-tokens", "8192", "--threads", "1")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        (worker,) = _children(proc.pid)
        heavy, _ = mapped_heavy(proc.pid)
        assert not heavy, heavy
        assert any("/torch/" in lib for lib in mapped_heavy(worker)[0])  # the check sees what it looks for
    finally:
        stop(proc)
