"""The documentation site builds cleanly, and its reference tables agree with the code.

The configuration reference in docs/engine.md is written by hand (so it can explain each setting) and
checked here: a new EngineConfig field, a changed default or a new `serve` / `worker` option fails
this test until the page is updated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench.prefill_plot import size_label
from engine.core.config import EngineConfig
from engine.protocol.slo import DEFAULT_CLASSES
from gateway.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"


def _section(page: str, heading: str) -> str:
    """The text under `heading` (a full heading line) up to the next heading of any level."""
    text = (DOCS / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    assert heading in lines, f"{page}: heading {heading!r} not found"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return "\n".join(lines[start:end])


def _table(section: str, every_table: bool = False) -> list[list[str]]:
    """Body rows of the first Markdown table in `section` (or of all its tables, each header
    included), cells stripped."""
    lines = [line.strip() for line in section.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    rows = ([line for line in lines if line.startswith("|")] if every_table
            else list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:])))
    assert len(rows) >= 2, "no table found"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def _code(cell: str) -> str:
    """`name` -> name; anything else (e.g. an em dash for 'none') -> ''."""
    m = re.fullmatch(r"`([^`]*)`", cell)
    return m.group(1) if m else ""


def _cli_options(command: str) -> set[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli_main([command, "--help"])
    assert exit_info.value.code == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # argparse may colour its help
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - {"--help"}


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in ("index", "quickstart", "concepts", "engine", "deploy", "benchmarks", "architecture"):
        expected = site / "index.html" if page == "index" else site / page / "index.html"
        assert expected.is_file(), f"{expected} was not built"


def test_engine_settings_table_matches_engine_config() -> None:
    rows = _table(_section("engine.md", "### Engine settings"))
    documented = {_code(r[0]): r for r in rows}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    missing = sorted(set(fields) - set(documented))
    stale = sorted(set(documented) - set(fields))
    assert not missing, f"EngineConfig fields missing from docs/engine.md 'Engine settings': {missing}"
    assert not stale, f"docs/engine.md 'Engine settings' lists fields EngineConfig does not have: {stale}"
    defaults = EngineConfig()
    for name, row in documented.items():
        assert _code(row[2]) == str(getattr(defaults, name)), (
            f"docs/engine.md: default of {name} is {row[2]}, EngineConfig says {getattr(defaults, name)!r}")


@pytest.mark.parametrize("command", ["serve", "worker", "gateway"])
def test_cli_options_are_documented(command: str) -> None:
    engine_rows = _table(_section("engine.md", "### Engine settings"))
    server_rows = _table(_section("engine.md", "### Server options"))
    gateway_rows = _table(_section("engine.md", "### Gateway options"))
    documented = {_code(r[0]) for r in gateway_rows if f"`{command}`" in r[1]}
    if command == "gateway":
        documented |= {"--host", "--port"}
    else:
        documented |= {_code(r[1]) for r in engine_rows} | {
            _code(r[0]) for r in server_rows if command == "worker" or "`flowprefill worker` only" not in r[2]}
    documented.discard("")
    actual = _cli_options(command)
    assert not actual - documented, (
        f"`flowprefill {command}` options missing from docs/engine.md: {sorted(actual - documented)}")
    assert not documented - actual, (
        f"docs/engine.md documents options `flowprefill {command}` does not have: {sorted(documented - actual)}")


def test_quickstart_has_the_readme_commands_verbatim() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2, "expected the README's two set-up commands"
    quickstart = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    for command in commands:
        assert command in quickstart, f"docs/quickstart.md lacks the README command: {command}"


def test_quickstart_slo_classes_match_defaults() -> None:
    rows = _table(_section("quickstart.md", "## SLO classes"))
    documented = {_code(r[0]): r for r in rows}
    assert set(documented) == set(DEFAULT_CLASSES)
    for name, c in DEFAULT_CLASSES.items():
        row = documented[name]
        assert [float(row[1]), float(row[2]), int(row[3]), row[4]] == [
            c.ttft_ms, c.tbt_ms, c.priority, "yes" if c.sheddable else "no"], f"SLO class {name}"


def test_benchmarks_page_has_its_sections_and_markers() -> None:
    for heading in ("## Prefill throughput vs transformers", "## Checkpoint overhead",
                    "## Preemption stop latency"):
        section = _section("benchmarks.md", heading)
        assert "flowprefill bench prefill" in section, heading


def test_benchmark_tables_are_the_benches_own_markdown() -> None:
    """Every row `bench prefill` writes to prefill.md for the committed runs is on the Benchmarks page."""
    from engine.bench.prefill_markdown import markdown

    text = (DOCS / "benchmarks.md").read_text()
    for name in ("prefill.json", "prefill-h200.json"):
        rows = [line for line in markdown(json.loads((RESULTS / name).read_text())).splitlines()
                if line.startswith("| ") and not line.startswith("| prompt")]
        assert len(rows) >= 8
        missing = [row for row in rows if row not in text]
        assert not missing, (name, missing)


def test_benchmark_tables_match_the_recorded_results() -> None:
    """The numbers on the Benchmarks page are the ones in the committed results files."""
    prefill = json.loads((RESULTS / "prefill.json").read_text())
    rows = {r[0]: r for r in _table(_section("benchmarks.md", "## Prefill throughput vs transformers"))}
    tput = prefill["throughput"]
    for n in tput["sizes"]:
        label = f"{n // 1024}K" if n >= 1024 else str(n)
        assert rows[label][1].startswith(f"{tput['tokens_per_s']['ours unsplit'][str(n)]:,.0f} "), label
        assert rows[label][3].startswith(f"{tput['tokens_per_s']['transformers'][str(n)]:,.0f} "), label
    stop = {r[0]: r for r in _table(_section("benchmarks.md", "## Preemption stop latency"))}
    for n in prefill["stop_latency"]["sizes"]:
        per = prefill["stop_latency"]["modes"]["split"][str(n)]
        label = f"{n // 1024}K" if n >= 1024 else str(n)
        assert stop[label][3] == f"{per['p99_ms']:.2f}", label
    h200 = json.loads((RESULTS / "prefill-h200.json").read_text())
    for results, heading in ((h200, "## On a GPU (NVIDIA H200, Llama 3.1 8B shape)"),
                             (json.loads((RESULTS / "prefill-h200-eager.json").read_text()),
                              "### CUDA graphs on and off")):
        rows = {r[0]: r for r in _table(_section("benchmarks.md", heading))}
        for n in results["throughput"]["sizes"]:
            for col, name in ((1, "ours unsplit"), (2, "ours preemptible"), (3, "transformers")):
                want = f"{results['throughput']['tokens_per_s'][name][str(n)]:,.0f} "
                assert rows[size_label(n)][col].startswith(want), (heading, n)
    stop = {r[0]: r for r in _table(_section("benchmarks.md", "### Stop latency on the GPU"))}
    for n in h200["stop_latency"]["sizes"]:
        label = size_label(n)
        for col, mode in ((3, "split"), (8, "unsplit")):
            assert stop[label][col] == f"{h200['stop_latency']['modes'][mode][str(n)]['p99_ms']:.2f}", label
    gw = json.loads((RESULTS / "gateway.json").read_text())
    rows = {r[0]: r for r in _table(_section("benchmarks.md", "## Gateway overhead"), every_table=True)}
    assert rows["non-streaming, end to end"][3] == f"{gw['non_streaming']['total']['added_p50_ms']:.2f}"
    assert rows["proxied requests/s on one core"][1].startswith(f"**{gw['throughput']['one_core_capacity_rps']:.0f}**")
    e2e = json.loads((RESULTS / "loadtest-e2e.json").read_text())
    rows = {_code(r[0]): r for r in _table(_section("benchmarks.md", "## Locust over HTTP, end to end"))}
    for name, pol in e2e["policies"].items():
        assert f"{pol['max_goodput_rps']:.2f}" in rows[name][6], name
        assert rows[name][7] == f"{pol['max_goodput_per_class_rps']:.2f}", name
    goodput = json.loads((RESULTS / "goodput-real.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    for name, pol in goodput["policies"].items():
        if name != "flowprefill-ideal":
            assert f"{pol['max_goodput_rps']:.2f}" in text, name


def test_documented_policies_exist() -> None:
    import engine.core.scheduler as scheduler

    rows = {_code(r[0]): r for r in _table(_section("engine.md", "### Server options"))}
    documented = re.findall(r"`([a-z][a-z0-9:N]*)`", rows["--policy"][2])
    assert documented, "docs/engine.md: the --policy row names no policy"
    for name in documented:
        scheduler.make_policy(name.replace("N", "2048"))  # raises ValueError for an unknown policy
    listed = getattr(scheduler, "POLICIES", ())  # the names make_policy advertises in its errors
    assert not set(listed) - set(documented), (
        f"policies missing from docs/engine.md's --policy row: {sorted(set(listed) - set(documented))}")


def test_gateway_config_reference_matches_code(tmp_path: Path) -> None:
    import msgspec

    from gateway.config import Discovery, GatewayConfig, Upstream

    rows = {_code(r[0]): r for r in _table(_section("engine.md", "### Gateway configuration file"))}
    fields = {f.name: f for f in msgspec.structs.fields(GatewayConfig)}
    for table, struct in (("upstream", Upstream), ("discovery", Discovery)):
        fields |= {f"{table}.{f.name}": f for f in msgspec.structs.fields(struct)}
        fields.pop(table)
    assert set(rows) == set(fields)
    for name, f in fields.items():
        default = f.default if f.default is not msgspec.NODEFAULT else None
        if isinstance(default, str | int | float) and not isinstance(default, bool):
            assert rows[name][1] == f"`{json.dumps(default)}`", name
    # the example in the section is a file the gateway accepts
    example = re.search(r"```toml\n(.*?)```", _section("engine.md", "### Gateway configuration file"), re.S)
    assert example is not None
    (tmp_path / "gw.toml").write_text(example.group(1))
    cfg = GatewayConfig.load(tmp_path / "gw.toml", ["http://127.0.0.1:1"])
    assert cfg.classes["interactive"].ttft_ms == 200 and cfg.api_keys["sk-batch-jobs"].ceiling == "relaxed"


def _documented_commands() -> list[tuple[str, list[str]]]:
    """(page, argv after `flowprefill`) for every flowprefill command in a bash block of the docs."""
    import shlex

    found = []
    pages = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    for page in pages:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0]
                for part in re.split(r"&&|\|\||;", line):
                    if "flowprefill" not in part:  # a multi-line JSON body's line is no shell line
                        continue
                    words = shlex.split(part.strip().rstrip("&").strip()) if part.strip() else []
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                        words = words[1:]
                    if words and words[0].endswith("flowprefill"):
                        found.append((page.name, words[1:]))
    return found


def test_every_documented_command_parses() -> None:
    """Every `flowprefill …` command in the docs is one the CLI accepts (options and values), so a
    renamed or removed option fails here; the long-running ones are not run, only parsed."""
    from engine.bench import kv_growth as bench_kv
    from engine.bench import prefill as bench_prefill
    from engine.bench import prefix_cache as bench_prefix
    from engine.bench.planner_validation import command as bench_planner
    from engine.planner import command as plan
    from gateway import bench as bench_gateway
    from gateway.cli import build_parser
    from gateway.epp import bench as bench_epp
    from loadtest import goodput as bench_goodput
    from loadtest import run as loadtest_run
    from loadtest.peer import cli as bench_peer
    from loadtest.profiles import BUILTIN

    commands = _documented_commands()
    assert len(commands) >= 15
    seen = set()
    for page, argv in commands:
        head = tuple(argv[:2]) if argv[:1] == ["bench"] else tuple(argv[:1])
        seen.add(head)
        sub = {("bench", "prefill"): bench_prefill.build_parser, ("bench", "goodput"): bench_goodput.build_parser,
               ("bench", "gateway"): bench_gateway.build_parser, ("bench", "prefix"): bench_prefix.build_parser,
               ("bench", "kv"): bench_kv.build_parser, ("bench", "peer"): bench_peer.build_parser,
               ("bench", "epp"): bench_epp.build_parser, ("bench", "planner"): bench_planner.build_parser,
               ("loadtest",): loadtest_run.build_parser, ("plan",): plan.build_parser}.get(head)
        try:
            if sub is None:
                build_parser().parse_args(argv)
            else:
                args = sub().parse_args(argv[len(head):])
                if head == ("loadtest",) and not args.profile.endswith(".toml"):
                    assert args.profile in BUILTIN, (page, argv)
        except SystemExit as exc:
            raise AssertionError(f"{page}: `flowprefill {' '.join(argv)}` is not accepted") from exc
    assert {("serve",), ("gateway",), ("loadtest",), ("bench", "goodput"), ("bench", "gateway")} <= seen


def test_otel_variable_table_matches_the_code_and_the_sdk() -> None:
    """Every OTEL_* variable telemetry/tracing.py reads is documented, and every documented one is a
    variable OpenTelemetry itself defines (so a typo or an invented name fails here)."""
    import opentelemetry.environment_variables as api_vars
    import opentelemetry.sdk.environment_variables as sdk_vars

    known = {v for mod in (api_vars, sdk_vars) for k, v in vars(mod).items() if k.startswith("OTEL_")}
    rows = _table(_section("observability.md", "## Turning tracing on"))
    documented = {name for row in rows for name in re.findall(r"`(OTEL_[A-Z_]+)`", row[0])}
    read = set(re.findall(r'"(OTEL_[A-Z_]+)"', (ROOT / "telemetry" / "tracing.py").read_text(encoding="utf-8")))
    assert read and read <= documented, f"read by tracing.py but not documented: {sorted(read - documented)}"
    assert documented <= known, f"not OpenTelemetry variables: {sorted(documented - known)}"


# -- docs/reference.md: the product contract, against the code ------------------------------------

# What the contract fixes (it may be extended, never renamed): a change here is a change of contract.
CONTRACT_METRICS = {
    "flowprefill_time_to_first_token_seconds", "flowprefill_slo_attained_total", "flowprefill_slo_violated_total",
    "flowprefill_preemptions_total", "flowprefill_preemption_latency_seconds", "flowprefill_requests_waiting",
    "flowprefill_requests_running", "flowprefill_requests_preempted", "flowprefill_kv_cache_usage_ratio",
    "flowprefill_gateway_requests_total", "flowprefill_gateway_shed_total"}
CONTRACT_PREEMPTED_ATTRS = {
    "flowprefill.preempted_by", "flowprefill.layer", "flowprefill.operator", "flowprefill.tokens_done",
    "flowprefill.victim_class", "flowprefill.by_class", "flowprefill.stop_latency_ms"}
ATTRIBUTE = re.compile(r"(?:flowprefill|gen_ai|server)\.[a-z_.]+")


def _codes(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def _metrics_in_code() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Exposition name -> (type, process, labels) of every metric telemetry/metrics.py defines."""
    import ast

    kinds = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Info": "info",
             "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge"}  # the last two: collectors'
    processes = {"EngineMetrics": "worker", "GatewayMetrics": "gateway", "EppMetrics": "epp",
                 "_PoolCollector": "gateway", "_WorkerCPUCollector": "worker"}
    suffix = {"counter": "_total", "info": "_info"}  # what prometheus_client exposes them as
    tree = ast.parse((ROOT / "telemetry" / "metrics.py").read_text(encoding="utf-8"))
    found = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        process = processes[cls.name]
        info_labels = {id(c.func.value): tuple(k.value for k in c.args[0].keys)  # Info(...).info({...})
                       for c in ast.walk(cls) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                       and c.func.attr == "info" and isinstance(c.args[0], ast.Dict)}
        for call in ast.walk(cls):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in kinds):
                continue
            kind = kinds[call.func.id]
            labels = next((a for a in call.args[2:3]), None) or next(
                (k.value for k in call.keywords if k.arg in ("labelnames", "labels")), None)
            names = tuple(e.value for e in labels.elts) if isinstance(labels, ast.List) else ()
            found[call.args[0].value + suffix.get(kind, "")] = (kind, process, info_labels.get(id(call), names))
    return found


def test_reference_metrics_match_the_code() -> None:
    rows = _table(_section("reference.md", "## Metrics"))
    documented = {_code(r[0]): (r[1], r[3], tuple(_codes(r[2]))) for r in rows}
    code = _metrics_in_code()
    assert len(code) > 20 and all(name.startswith("flowprefill_") for name in code)
    missing, stale = sorted(set(code) - set(documented)), sorted(set(documented) - set(code))
    assert not missing, f"metrics missing from docs/reference.md: {missing}"
    assert not stale, f"docs/reference.md lists metrics the code lacks: {stale}"
    for name, (kind, process, labels) in code.items():
        assert documented[name] == (kind, process, labels), (name, documented[name])
    contract = {_code(r[0]) for r in rows if r[4] == "yes"}
    assert contract == CONTRACT_METRICS, "the reference page's contract metrics are not the contract's"
    assert all(r[4] in ("yes", "extension") for r in rows)


def _span_rows() -> dict[str, set[str]]:
    """First span name of each row of the reference's span table -> its attributes."""
    rows = _table(_section("reference.md", "## Traces"))
    return {_codes(r[0])[0] if _codes(r[0]) else r[0]: set(_codes(r[2])) for r in rows}


def test_reference_span_attributes_match_the_tracer() -> None:
    """Every attribute telemetry/tracing.py sets is on the page, under the span that carries it, and
    nothing else; the contract's `preempted` attributes are all there."""
    import ast

    source = (ROOT / "telemetry" / "tracing.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    set_by_tracer = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and ATTRIBUTE.fullmatch(n.value)}
    children: dict[str, set[str]] = {}  # self._child(rt, "NAME", …, attributes={…})
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "_child":
            attrs = next((k.value for k in call.keywords if k.arg == "attributes"), None)
            keys = {k.value for k in attrs.keys} if isinstance(attrs, ast.Dict) else set()
            children.setdefault(call.args[1].value, set()).update(keys)
    spans = _span_rows()
    worker_spans = {name: attrs for name, attrs in spans.items() if name not in ("kv_transfer", "POST /v1/…")}
    assert set(children) | {"text_completion <model>"} == set(worker_spans)
    for name, keys in children.items():
        assert keys <= worker_spans[name], (name, sorted(keys - worker_spans[name]))
    # (a request's end cuts short whichever interval is open: queue, prefill or preempted)
    assert spans["preempted"] == children["preempted"] | {"flowprefill.interrupted_by"}
    assert spans["preempted"] >= CONTRACT_PREEMPTED_ATTRS
    documented = set().union(*worker_spans.values())
    assert documented == set_by_tracer, (f"set by tracing.py, not on docs/reference.md: "
                                         f"{sorted(set_by_tracer - documented)}; on the page, not set: "
                                         f"{sorted(documented - set_by_tracer)}")
    # the spans other modules open: what the page says they carry is set there
    for name, marker in (("kv_transfer", '"kv_transfer"'), ("POST /v1/…", "flowprefill.route.worker")):
        opening = [p for p in (*(ROOT / "engine").rglob("*.py"), *(ROOT / "gateway").rglob("*.py"))
                   if marker in p.read_text(encoding="utf-8")]
        assert opening, f"no module opens the {name} span"
        literals = set().union(*(ATTRIBUTE.findall(p.read_text(encoding="utf-8")) for p in opening))
        assert spans[name] <= literals, (name, sorted(spans[name] - literals))


def test_reference_default_classes_match_the_code() -> None:
    from loadtest.workload import ClassRule

    rows = _table(_section("reference.md", "## Default SLO classes"))
    documented = {_code(r[0]): r for r in rows}
    assert set(documented) == set(DEFAULT_CLASSES)
    paper_type = {cls: t for t, cls in ClassRule().by_type.items()}
    for name, c in DEFAULT_CLASSES.items():
        row = documented[name]
        assert [float(row[1]), float(row[2]), int(row[3]), row[4], row[5]] == [
            c.ttft_ms, c.tbt_ms, c.priority, "yes" if c.sheddable else "no", paper_type[name]], name


def test_nothing_cites_a_spec_outside_the_repository() -> None:
    """The contract is docs/reference.md; no help text, page or comment points at a file users lack."""
    cited = re.compile(r"\bSPEC\b")
    skip = {".git", ".venv", "site", "bench-results", "node_modules", "__pycache__"}
    hits = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if (set(rel.parts) & skip or rel.parts[0].startswith(".") or "egg-info" in str(rel)
                or path.suffix not in (".py", ".md", ".toml", ".yml", ".yaml", ".txt") or path.name == "test_docs.py"):
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if cited.search(line):
                hits.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not hits, "cite docs/reference.md instead:\n" + "\n".join(hits)
