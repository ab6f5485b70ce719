"""The `flowprefill` command line as a new user meets it: every option explained with its default,
`--version`, mistakes as one line on stderr with exit 2 (a missing model directory, an unknown
policy, a bad gateway TOML, a port in use), `serve` stopping with the reason when a worker cannot
start, and the dispatcher loading no torch for `--help` and `gateway`."""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import pytest
from processes import free_port, in_process

from gateway.cli import BENCHES, SERVERS, TOOLS, build_parser
from gateway.cli.options import engine_config, to_argv, worker_options


def flowprefill(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command that refused its input (exit 2), without its prefix."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@contextmanager
def taken(port: int) -> Iterator[None]:
    """Another program listening on 127.0.0.1:port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version() -> None:
    done = flowprefill("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"flowprefill {version('flowprefill')}"


@pytest.mark.parametrize("command", sorted(SERVERS))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = subparsers(build_parser())[command]
    assert parser.description and len(parser.description) > 80, f"`flowprefill {command}` has no description"
    undocumented = [a.option_strings for a in parser._actions if not a.help]
    assert not undocumented, f"`flowprefill {command}` options without help: {undocumented}"
    text = parser.format_help()
    if command not in ("gateway", "epp"):  # the engine's commands
        assert "tokens per KV-cache block" in text and "(default: 256)" in text  # --kv-block-size
        assert "(default: flowprefill)" in text and "chunked:N" in text  # --policy, its names from the registry
    assert f"(default: {9002 if command == 'epp' else 8000})" in text  # --port


def test_loadtest_goodput_and_plan_options_have_help() -> None:
    from engine.bench.planner_validation import command as bench_planner
    from engine.planner import command as plan
    from loadtest import goodput, run

    for parser in (run.build_parser(), goodput.build_parser(), plan.build_parser(), bench_planner.build_parser()):
        undocumented = [a.option_strings for a in parser._actions if not a.help]
        assert not undocumented, f"`{parser.prog}` options without help: {undocumented}"
    text = plan.build_parser().format_help()
    assert "(default: 0.9)" in text and "(default: 64)" in text and "(default: cpu)" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "1.5"], "--target 1.5: a share of requests in (0, 1]"),
    (["--policies", "fastest"], "unknown policy 'fastest'"),
    (["--rate", "5", "--native-rate"], "not allowed with argument"),
    (["--cost", "gpt-5@h100"], "unknown model 'gpt-5'"),
    (["--workload", "/nonexistent.csv"], "trace file /nonexistent.csv does not exist"),
    (["--skip", "-1"], "--skip must be >= 0"),
    (["--engine-pass", "-1"], "--pilot and --engine-pass must be >= 0"),
    (["--pilot", "-1"], "--pilot and --engine-pass must be >= 0"),
    (["--pilot-runs", "0"], "--pilot-runs must be >= 1"),
    (["--headroom", "-0.1"], "--headroom must be in [0, 10]"),
    (["--requests", "10", "--skip", "30000"], "none left after skipping 30000"),
    (["--speed-from", "/nonexistent"], "--speed-from /nonexistent: no batch log there"),
])
def test_a_plan_mistake_is_one_line_and_exit_2(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(in_process(capsys, "plan", *argv))
    assert line.startswith("flowprefill plan: error: ") and message in line, line


@pytest.mark.parametrize(("argv", "message"), [
    (["--against-serve", "1,x"], "expected worker counts"),
    (["--against-serve", "1", "--repeats", "0"], "--repeats must be >= 1"),
    (["--against-serve", "1", "--cost", "llama-3.1-8b@h100"], "use it with --cost cpu"),
    (["--against-serve", "1", "--target", "1.5"], "--target 1.5: a share of requests in (0, 1]"),  # plan's own
    (["--requests", "8"], "--against-serve N,N is required"),
])
def test_a_bench_planner_mistake_is_one_line_and_exit_2(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(in_process(capsys, "bench", "planner", *argv))
    assert line.startswith("flowprefill bench planner: error: ") and message in line, line


@pytest.mark.parametrize("argv", [["--against-serve", "1"], ["--repeats", "3"], ["--interleave-pilots"],
                                  ["--requests", "8", "--against-serve=1,2"]])
def test_plan_refuses_the_options_that_moved_to_bench_planner(argv: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`plan` no longer runs real fleets: their options are `flowprefill bench planner`'s, and `plan`
    says so in one line (not hidden in its help)."""
    line = one_line_error(in_process(capsys, "plan", *argv))
    flag = next(a for a in argv if a.startswith("--") and a != "--requests").split("=")[0]
    assert line.startswith(f"flowprefill plan: error: {flag} moved: flowprefill bench planner"), line
    from engine.planner import command as plan

    assert flag not in plan.build_parser().format_help()


def test_help_and_gateway_load_no_torch() -> None:
    """The dispatcher and the gateway's options import neither torch nor numpy (later the gateway
    runs without them)."""
    code = ("import contextlib, io, sys\nfrom gateway.cli import main\n"
            "for argv in (['--help'], ['gateway', '--help'], ['bench', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_serve_passes_every_engine_option_to_its_workers(tiny_checkpoint: Callable[[str], Path]) -> None:
    """`serve` hands its workers exactly the engine settings it was given (one definition of them)."""
    argv = ["--model", str(tiny_checkpoint("llama")), "--dtype", "bfloat16", "--kv-block-size", "16",
            "--no-prefix-caching", "--threads", "3", "--step-budget-ms", "0.5", "--policy", "chunked:512:fcfs",
            "--tool-call-parser", "hermes", "--attention-backend", "sdpa"]
    serve = build_parser().parse_args(["serve", *argv])
    worker = build_parser().parse_args(["worker", *to_argv(serve, worker_options())])
    assert engine_config(worker) == engine_config(serve)
    assert (worker.policy, worker.tool_call_parser) == ("chunked:512:fcfs", "hermes")
    assert engine_config(worker).prefix_caching is False and engine_config(worker).num_threads == 3
    assert to_argv(build_parser().parse_args(["serve"]), worker_options()) == []  # defaults stay implicit


def test_serve_turns_prefix_affinity_off_where_its_workers_cache_no_prefixes(caplog: pytest.LogCaptureFixture) -> None:
    """With `--no-prefix-caching` affinity saves nothing and only overrides load: the gateway `serve`
    starts routes by load alone (once said in the log); with caching on, the configuration's value stands."""
    from gateway.cli.serve import without_pointless_affinity
    from gateway.config import GatewayConfig

    parser = build_parser()
    configured = GatewayConfig(prefix_affinity_chars=2048)
    with caplog.at_level("INFO", logger="flowprefill.serve"):
        off = without_pointless_affinity(configured, parser.parse_args(["serve", "--no-prefix-caching"]))
    assert off.prefix_affinity_chars == 0 and configured.prefix_affinity_chars == 2048
    assert [r.getMessage() for r in caplog.records] == [
        "prefix affinity off: the workers run without prefix caching (prefix_affinity_chars 2048 ignored)"]
    assert without_pointless_affinity(configured, parser.parse_args(["serve"])) is configured
    assert without_pointless_affinity(GatewayConfig(), parser.parse_args(["serve"])).prefix_affinity_chars == 1024


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
    (["worker", "--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
    (["serve", "--policy", "fastest"], "unknown policy 'fastest': choose from flowprefill, fcfs, chunked:N"),
    (["worker", "--policy", "chunked:x"], "expected chunked:N with N tokens"),
    (["gateway", "--workers", "http://127.0.0.1:1", "--config", "/nonexistent.toml"],
     "--config /nonexistent.toml: no such file or directory"),
    (["gateway", "--workers", "http://127.0.0.1:1", "--port", "70000"], "70000 is not a TCP port (1 to 65535)"),
    (["serve", "--port", "65535"], "--port 65535 leaves no room for 1 worker port(s) after it"),
])
def test_a_mistake_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(in_process(capsys, *argv))
    assert line.startswith(f"flowprefill {argv[0]}: error: ") and message in line, line
    if "--model" in argv:  # the loader's own words (docs/engine.md, Error messages)
        assert line == f"flowprefill {argv[0]}: error: {message}"


@pytest.mark.parametrize("argv", [*(["bench", name] for name in BENCHES), *([name] for name in TOOLS)],
                         ids=lambda argv: " ".join(argv))
def test_every_benchmark_and_tool_says_a_mistake_in_one_line(argv: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each parses its own arguments: a wrong option is one line naming the command, and exit 2 (not
    argparse's usage block, which buried the error under 20-40 lines of options)."""
    line = one_line_error(in_process(capsys, *argv, "--no-such-option"))
    assert line == (f"flowprefill {' '.join(argv)}: error: unrecognized arguments: --no-such-option"), line


def test_a_model_directory_without_config_json(tmp_path: Path) -> None:
    line = one_line_error(flowprefill("serve", "--model", str(tmp_path)))
    assert f"{tmp_path}: no config.json" in line


@pytest.mark.parametrize(("command", "toml", "message"), [
    ("gateway", "default_class = [\n", "Invalid value"),
    ("gateway", "[upstream]\nkindd = 1\n", "unknown field `kindd`"),
    ("serve", 'default_class = "nope"\n', "unknown SLO class 'nope'"),  # before any worker starts
])
def test_a_bad_gateway_config_is_one_line(tmp_path: Path, command: str, toml: str, message: str) -> None:
    (tmp_path / "gw.toml").write_text(toml)
    argv = ["--workers", "http://127.0.0.1:1"] if command == "gateway" else ["--port", str(free_port(span=2))]
    done = flowprefill(command, *argv, "--config", str(tmp_path / "gw.toml"))
    line = one_line_error(done)
    assert f"--config {tmp_path / 'gw.toml'}: " in line and message in line, line
    assert not done.stdout  # nothing announced, no worker started


@pytest.mark.parametrize("which", ["gateway", "worker"])
def test_serve_with_a_port_in_use_says_which_and_starts_nothing(which: str) -> None:
    port = free_port(span=2)
    with taken(port if which == "gateway" else port + 1):
        done = flowprefill("serve", "--port", str(port), "--threads", "1")
    line = one_line_error(done)
    assert line == (f"flowprefill serve: error: the gateway on 127.0.0.1:{port}: address already in use"
                    if which == "gateway" else
                    f"flowprefill serve: error: engine worker on port {port + 1}: address already in use")
    assert not done.stdout  # no URL announced


def test_gateway_and_worker_with_their_port_in_use() -> None:
    port = free_port()
    with taken(port):
        for command, argv in (("gateway", ["--workers", "http://127.0.0.1:1"]), ("worker", [])):
            done = flowprefill(command, "--port", str(port), *argv)
            assert one_line_error(done).endswith(f"on 127.0.0.1:{port}: address already in use")
            assert not done.stdout


def test_serve_stops_with_the_reason_a_worker_could_not_start(
        tmp_path: Path, tiny_checkpoint: Callable[[str], Path]) -> None:
    """A checkpoint whose config.json reads but whose weights are missing: the worker process fails
    (its loader's message), and `serve` exits with that as its one line of error."""
    model = tmp_path / "no-weights"
    model.mkdir()
    shutil.copy(tiny_checkpoint("llama") / "config.json", model)
    port = free_port(span=2)
    done = flowprefill("serve", "--port", str(port), "--model", str(model), "--threads", "1")
    assert one_line_error(done) == (f"flowprefill serve: error: engine worker on port {port + 1}: "
                                    f"{model}: no model.safetensors or model.safetensors.index.json")
    assert not done.stdout
