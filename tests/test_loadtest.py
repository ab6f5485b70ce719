"""Locust load profiles: schedules, profile validation, and headless / distributed / web-UI runs
against a real `flowprefill serve`."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
from processes import free_port, serving

from gateway.cli import main as flowprefill
from loadtest.profiles import BUILTIN, Profile, ProfileError, load_profile
from loadtest.run import LOCUSTFILE

# A small burst: two long batch requests, then an interactive spike over them; one of each other class.
# The spike is sent within 0.1-0.225 s, while the backlog (two 6,000-token prompts, about 0.5 s of prefill
# on an AVX-512 core with oneDNN's projections) is still being answered.
SMALL = """
kind = "burst"
backlog_requests = 2
backlog_tokens = 6000
burst_at_s = 0.1
burst_requests = 6
burst_rate = 40
burst_tokens = 100
max_tokens = 4
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # These tests check the load generator's accounting, so nothing of theirs is refused on a
    # prediction: batch is not sheddable here (in one CI run the correction refused both backlog
    # requests as predicted misses; shedding has its own tests in test_late.py and test_gateway.py).
    config = tmp_path_factory.mktemp("served") / "classes.toml"
    config.write_text("[classes.batch]\nsheddable = false\n")
    with serving("--config", str(config)) as url:
        yield url


def test_schedules() -> None:
    p = load_profile("steady", rate=4.0, requests=50)
    s = p.schedule()
    assert len(s) == 50 and s.workload.requests[0].arrival_s == 0.0
    assert 2.0 < s.workload.rate < 8.0  # Poisson around 4 req/s
    assert p.schedule().workload == s.workload  # deterministic: every Locust process builds the same
    ramp = Profile(kind="ramp", rates=[1, 3], step_s=10, lengths="mix").schedule()
    assert sorted(set(ramp.phase)) == [1, 3]
    assert all(r.arrival_s < 10 for r, ph in zip(ramp.workload.requests, ramp.phase, strict=True) if ph == 1)
    burst = Profile(kind="burst", backlog_requests=3, burst_requests=5).schedule()
    assert [r.slo_class for r in burst.workload.requests] == ["batch"] * 3 + ["interactive"] * 5
    trace = load_profile("azure", rate=2.0, requests=30).schedule()
    assert len(trace) == 30 and trace.workload.rate == pytest.approx(2.0)
    assert {r.slo_class for r in trace.workload.requests} <= {"interactive", "standard", "relaxed", "batch"}


@pytest.mark.parametrize(("text", "message"), [
    ('kind = "poisson"\nrate = -1', "rate must be > 0"),
    ('kind = "poisson"', "rate is required"),
    ('kind = "ramp"\nrates = []', "rates must list rates > 0"),
    ('kind = "burst"\nburst_class = "vip"', "unknown SLO class 'vip'"),
    ('kind = "burst"\nshared_prefixes = 0', "shared_prefix_tokens/shared_prefixes must be >= 0 / >= 1"),
    ('kind = "trace"\ntrace = "/nonexistent.csv"', "is not azure-mix, long-mix, mooncake-4k or an existing trace file"),
    ('kind = "sometimes"', "Invalid enum value 'sometimes' - at `$.kind` (kind: poisson"),
    ('kind = "poisson"\nrate = 1\nrat = 2', "unknown field `rat`"),
    ('kind = "poisson"\nrate = "fast"', "Expected `float | null`, got `str` - at `$.rate`"),
    ("kind = ", "not valid TOML"),
])
def test_bad_profiles_rejected(tmp_path: Path, text: str, message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=re.escape(message)):
        load_profile(str(path))
    # the command refuses it before starting Locust, with the message and exit code 2
    assert flowprefill(["loadtest", "--profile", str(path), "--host", "http://127.0.0.1:9"]) == 2
    assert message in capsys.readouterr().out


def test_unknown_profile_name() -> None:
    with pytest.raises(ProfileError, match="neither a built-in"):
        load_profile("stedy")
    assert set(BUILTIN) == {"steady", "ramp", "burst", "burst-tiny", "azure"}


def _check_report(out: Path, n_classes: set[str]) -> dict:
    doc = json.loads((out / "goodput.json").read_text())
    a = doc["accounting"]
    assert a["sent"] == a["succeeded"] + a["failed"] and a["missing"] == 0 and a["scheduled"] == a["sent"]
    assert doc["engine"] == "http" and set(doc["policies"]) == {"http"}
    (pt,) = doc["policies"]["http"]["points"]
    assert set(pt["per_class"]) == n_classes
    assert sum(c["n"] for c in pt["per_class"].values()) == a["scheduled"]
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert sorted(int(r["index"]) for r in rows) == list(range(a["scheduled"]))
    assert (out / "goodput.png").stat().st_size > 10_000
    return doc


@pytest.mark.slow
def test_headless_run_accounts_for_every_request(served: str, tmp_path: Path) -> None:
    (tmp_path / "small.toml").write_text(SMALL)
    out = tmp_path / "out"
    assert flowprefill(["loadtest", "--profile", str(tmp_path / "small.toml"), "--host", served,
                        "--out", str(out)]) == 0
    doc = _check_report(out, {"batch", "interactive"})
    assert doc["accounting"]["failed"] == 0
    assert doc["loadgen"]["cores_used"] > 0 and doc["loadgen"]["processes"] == 1
    # Open loop: the spike was sent while the long requests were still being answered.
    rows = list(csv.DictReader((out / "requests.csv").open()))
    sent = {int(r["index"]): float(r["scheduled_s"]) + float(r["lag_ms"]) / 1000 for r in rows}
    first_batch_done = min(sent[int(r["index"])] + float(r["e2e_ms"]) / 1000 for r in rows
                           if r["slo_class"] == "batch")
    assert sum(sent[int(r["index"])] < first_batch_done for r in rows if r["slo_class"] == "interactive") >= 3
    assert all(r["applied_class"] == r["slo_class"] for r in rows)


@pytest.mark.slow
def test_chat_endpoint_profile(served: str, tmp_path: Path) -> None:
    """`endpoint = "chat"` sends each prompt as a chat message's text (it used to be random bytes that
    are not UTF-8: every request failed in the load generator before it was sent)."""
    (tmp_path / "chat.toml").write_text(SMALL.replace("6000", "1000") + 'endpoint = "chat"\n')
    out = tmp_path / "out"
    assert flowprefill(["loadtest", "--profile", str(tmp_path / "chat.toml"), "--host", served,
                        "--out", str(out)]) == 0
    doc = _check_report(out, {"batch", "interactive"})
    assert doc["accounting"]["failed"] == 0 and doc["accounting"]["succeeded"] == 8, doc["errors"]


def _prefix_hits(served: str) -> float:
    worker = served.rsplit(":", 1)[0] + f":{int(served.rsplit(':', 1)[1]) + 1}"
    return sum(float(line.split()[-1]) for line in httpx.get(f"{worker}/metrics").text.splitlines()
               if line.startswith("flowprefill_prefix_cache_hits_total"))


def _prefix_hits_of(served: str, profile: Path, out: Path) -> float:
    """The prefix-cache hits (tokens) a loadtest of `profile` adds on the served worker; none of it fails."""
    before = _prefix_hits(served)
    assert flowprefill(["loadtest", "--profile", str(profile), "--host", served, "--out", str(out)]) == 0
    assert json.loads((out / "goodput.json").read_text())["accounting"]["failed"] == 0
    return _prefix_hits(served) - before


@pytest.mark.slow
def test_shared_prefixes_load_the_prefix_cache(served: str, tmp_path: Path) -> None:
    """Every prompt starts with the same 512 tokens: after the first, each finds them cached (two
    256-token blocks); the rest of each prompt is its own."""
    (tmp_path / "shared.toml").write_text('kind = "burst"\nbacklog_requests = 1\nbacklog_tokens = 600\n'
                                          'burst_requests = 6\nburst_tokens = 600\nburst_rate = 10\n'
                                          'burst_at_s = 0.5\nmax_tokens = 2\nshared_prefix_tokens = 512\n')
    assert _prefix_hits_of(served, tmp_path / "shared.toml", tmp_path / "out") >= 6 * 512


@pytest.mark.slow
def test_a_traces_named_blocks_load_the_prefix_cache(served: str, tmp_path: Path) -> None:
    """A Mooncake JSONL trace names each prompt's 512-token blocks: four 600-token prompts sharing their
    first block's id share its tokens, so each after the first finds them cached (two 256-token blocks)."""
    rows = [{"timestamp": 0.6 * k, "input_length": 600, "output_length": 2, "hash_ids": [7, 100 + k]}
            for k in range(4)]
    (tmp_path / "trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "trace.toml").write_text(f'kind = "trace"\ntrace = "{tmp_path / "trace.jsonl"}"\nmax_tokens = 2\n')
    assert _prefix_hits_of(served, tmp_path / "trace.toml", tmp_path / "out") >= 3 * 512


@pytest.mark.slow
def test_distributed_two_workers(served: str, tmp_path: Path) -> None:
    (tmp_path / "small.toml").write_text(SMALL)
    out = tmp_path / "out"
    assert flowprefill(["loadtest", "--profile", str(tmp_path / "small.toml"), "--host", served,
                        "--processes", "2", "--max-in-flight", "8", "--out", str(out)]) == 0
    doc = _check_report(out, {"batch", "interactive"})
    assert doc["accounting"]["failed"] == 0 and doc["loadgen"]["processes"] == 3


def _earlier_report(out: Path) -> dict[str, tuple[bytes, int]]:
    """An earlier run's report files in `out`, a day old: {name: (bytes, mtime in ns)}."""
    out.mkdir()
    for name in ("goodput.json", "goodput.png", "requests.csv"):
        (out / name).write_bytes(f"the earlier run's {name}".encode())
        os.utime(out / name, ns=(time.time_ns() - 86_400 * 10**9,) * 2)
    return _files(out)


def _files(out: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()}


def test_an_unreachable_host_is_one_line_and_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A closed port: said before anything starts, in one line naming the URL, exit 2; the earlier
    report is left as it was, byte for byte, and nothing is added beside it."""
    (tmp_path / "small.toml").write_text(SMALL)
    out = tmp_path / "out"
    earlier = _earlier_report(out)
    host = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert flowprefill(["loadtest", "--profile", str(tmp_path / "small.toml"), "--host", host,
                        "--out", str(out)]) == 2
    assert time.monotonic() - t0 < 5  # no Locust run, no waiting for answers
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flowprefill loadtest: error: cannot reach {host}: "), err
    assert _files(out) == earlier and sorted(p.name for p in out.iterdir()) == sorted(earlier)


@contextmanager
def answers_once() -> Iterator[str]:
    """An HTTP server that answers one request (the load test's check that it is there), then goes
    away: every request of the run is refused."""

    class Once(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"object": "list", "data": [{"id": "gone", "object": "model"}]}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Once)
    thread = threading.Thread(target=lambda: (server.handle_request(), server.server_close()))
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        thread.join(10)


def test_a_server_gone_after_the_start_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Most requests could not connect: exit 1 and one line saying so; every request is still accounted
    for, as a connection failure, in the run's own report, set aside under failed/; the earlier report
    stays."""
    (tmp_path / "small.toml").write_text(SMALL)
    out = tmp_path / "out"
    earlier = _earlier_report(out)
    with answers_once() as host:
        assert flowprefill(["loadtest", "--profile", str(tmp_path / "small.toml"), "--host", host,
                            "--out", str(out), "--drain-s", "10"]) == 1
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1, printed.err
    assert printed.err.startswith(f"flowprefill loadtest: error: 8 of 8 requests could not connect to {host} "
                                  "(Connection refused): the server is down or went away; "), printed.err
    assert f"this run's files are in {out / 'failed'}, nothing in {out} was replaced" in printed.err
    assert _files(out) == earlier and sorted(p.name for p in out.iterdir()) == sorted([*earlier, "failed"])
    doc = _check_report(out / "failed", {"batch", "interactive"})
    assert doc["accounting"]["failed"] == doc["accounting"]["sent"] == 8
    assert doc["errors"] == {"connection failed (Connection refused)": 8}
    assert "failed by cause: 8 connection failed (Connection refused)" in printed.out
    # its max goodput is 0, and says why: no rate reached 90 %
    assert doc["policies"]["http"]["max_goodput_note"] == "below 90 % at every rate"
    assert "max goodput: 0 req/s (below 90 % at every rate)" in printed.out


def test_a_report_below_the_target_at_every_rate_says_so() -> None:
    """goodput.json's max goodput of 0 beside a point's goodput of 1.6 req/s: its note says why."""
    from loadtest.report import Outcome, point, report

    def pt(rate: float, interactive: int, batch: int) -> dict:  # of 10 requests a class, how many attained
        return point(rate, [Outcome(c, 1.0, 0.5 if i < k else None)
                            for c, k in (("interactive", interactive), ("batch", batch)) for i in range(10)])

    policies = {"below": [pt(2, 8, 8), pt(4, 5, 5)], "one class below": [pt(2, 10, 8), pt(4, 10, 6)],
                "met": [pt(2, 10, 10), pt(4, 7, 7)]}
    doc = report({}, "http", "m", 1.0, {}, policies)
    below = doc["policies"]["below"]
    assert below["max_goodput_rps"] == 0 and below["points"][0]["goodput_rps"] == pytest.approx(1.6)
    assert below["max_goodput_note"] == "below 90 % at every rate"
    assert doc["policies"]["one class below"]["max_goodput_rps"] > 0
    assert doc["policies"]["one class below"]["max_goodput_note"] == "no rate with every class >= 90 %"
    assert doc["policies"]["met"]["max_goodput_note"] is None


def test_failures_counted_by_cause() -> None:
    """A shed request is counted by the OpenAI error body's code, one with no answer by its innermost
    cause, so a run's summary says why it failed."""
    import requests

    from loadtest.results import Record, _errors, no_answer

    shed = ('HTTP 429: {"error": {"message": "predicted TTFT 7100 ms > 6000 ms", "type": '
            '"rate_limit_error", "param": null, "code": "predicted_slo_miss"}}')
    with pytest.raises(requests.exceptions.ConnectionError) as refused:  # what Locust keeps of a closed port
        requests.post(f"http://127.0.0.1:{free_port()}/v1/completions", timeout=5)
    errors = [shed, shed, 'HTTP 400: {"error": {"message": "bad", "type": "invalid_request_error"}}',
              "HTTP 502: <html>bad gateway</html>", "interrupted: stream ended without [DONE]", None,
              no_answer(refused.value), no_answer(requests.exceptions.ReadTimeout("read timed out"))]
    records = [Record(index=i, slo_class="batch", input_tokens=8, scheduled_s=0.0, error=e)
               for i, e in enumerate(errors)]
    assert _errors(records) == {"HTTP 429 predicted_slo_miss": 2, "HTTP 400 invalid_request_error": 1,
                                "HTTP 502": 1, "interrupted": 1, "connection failed (Connection refused)": 1,
                                "no answer (read timed out)": 1}


@pytest.mark.slow
def test_web_ui_slo_tab(served: str, tmp_path: Path) -> None:
    (tmp_path / "small.toml").write_text(SMALL)
    port = free_port()
    log = (tmp_path / "locust.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", served,
                             "--load-profile", str(tmp_path / "small.toml"), "--web-host", "127.0.0.1",
                             "--web-port", str(port), "--autostart"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, rows = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            try:
                stats = httpx.get(f"http://127.0.0.1:{port}/stats/requests", timeout=2).json()
                (tab,) = [t for t in stats.get("extended_stats", []) if t["key"] == "slo"]
                rows = tab["data"]
                if sum(r["requests"] for r in rows) == 8:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    assert {r["slo_class"] for r in rows} == {"batch", "interactive"}
    assert sum(r["requests"] for r in rows) == 8
    assert '"extended_tabs"' in page or "extended_tabs" in page
    # attainment as the command line shows it (a percentage), not a bare share
    assert all(re.fullmatch(r"\d+%", r["attainment"]) for r in rows), rows
    # the form opens at what the run uses: the in-flight bound as users, a spawn rate Locust does not warn of
    args = json.JSONDecoder().raw_decode(page.split("window.templateArgs = ", 1)[1])[0]
    assert (args["num_users"], args["spawn_rate"], args["hide_common_options"]) == (128, 100.0, False)
    assert "max_in_flight" not in args["extra_options"]  # one knob for it in the form: the users
    text = (tmp_path / "locust.log").read_text()
    assert "All users spawned" in text and "spawn rate is very high" not in text, text[-2000:]


def test_trace_replay_profile_from_mooncake_jsonl(tmp_path: Path) -> None:
    """A profile replays any loader's trace: here Mooncake JSONL with types, windowed and rate-scaled."""
    trace = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 10_000 * i, "input_length": 100 + i, "output_length": 5, "type": t}
            for i, t in enumerate(["text", "file", "search", "image"] * 5)]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "p.toml").write_text(
        f'kind = "trace"\ntrace = "{trace}"\nwindow_start_s = 40\nwindow_s = 80\nrate = 2\n')
    s = load_profile(str(tmp_path / "p.toml")).schedule()
    assert [r.input_tokens for r in s.workload.requests] == list(range(104, 112))
    assert [r.slo_class for r in s.workload.requests[:4]] == ["interactive", "batch", "relaxed", "standard"]
    assert s.workload.rate == pytest.approx(2.0)


def test_documented_locust_commands_parse() -> None:
    """The `locust -f loadtest/locustfile.py …` commands in the docs are accepted by Locust's own
    parser with this locustfile's options (in a fresh process: Locust must patch the stdlib first)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "loadtest.md").read_text()
    commands = [line.split(" #")[0] for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith(".venv/bin/locust ")]
    assert len(commands) >= 3
    code = """
import json, shlex, sys
import locust.argument_parser as locust_args
from locust import events
import loadtest.locustfile
from loadtest.profiles import BUILTIN
for cmd in json.loads(sys.argv[1]):
    parser = locust_args.get_parser()
    events.init_command_line_parser.fire(parser=parser)
    opts = parser.parse_args(shlex.split(cmd)[1:])
    assert opts.locustfile.endswith("loadtest/locustfile.py"), cmd
    assert opts.load_profile in BUILTIN or opts.load_profile.endswith(".toml"), cmd
print("ok", len(json.loads(sys.argv[1])))
"""
    out = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_documented_locust_is_the_venvs() -> None:
    """The docs' setup installs Locust into .venv, whose bin is not on PATH: every command that runs
    Locust says `.venv/bin/locust` (a bare `locust` is "command not found"), and that file exists."""
    root = Path(__file__).resolve().parents[1]
    pages = [*sorted((root / "docs").glob("*.md")), root / "README.md"]
    lines = [(page.name, line.strip()) for page in pages
             for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S) for line in block.splitlines()]
    lines += [("locustfile.py", line.strip()) for line in (LOCUSTFILE.read_text().split('"""')[1]).splitlines()]
    runs = [(page, line) for page, line in lines if re.search(r"(^|[\s/])locust\s", line)]
    assert len(runs) >= 4
    bare = [(page, line) for page, line in runs if not line.startswith(".venv/bin/locust ")]
    assert not bare, bare
    assert (Path(sys.executable).parent / "locust").is_file()


@pytest.mark.slow
def test_burst_profile_shows_preemption(served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in `burst`, as the Quickstart runs it: no request refused (with 8,000-token backlog
    requests a busy machine's worker shed them all as predicted misses), the backlog preempted by the
    spike (counted by the server, in the report and on the command line), and every backlog request
    answered and reported."""
    monkeypatch.delenv("COLUMNS", raising=False)
    worker = served.rsplit(":", 1)[0] + f":{int(served.rsplit(':', 1)[1]) + 1}"

    def preemptions() -> float:
        return sum(float(line.split()[-1]) for line in httpx.get(f"{worker}/metrics").text.splitlines()
                   if line.startswith("flowprefill_preemptions_total{"))

    before = preemptions()
    out = tmp_path / "out"
    assert flowprefill(["loadtest", "--profile", "burst-tiny", "--host", served, "--out", str(out)]) == 0
    counted = preemptions() - before
    printed = capsys.readouterr().out
    doc = _check_report(out, {"batch", "interactive"})
    assert doc["accounting"]["failed"] == 0, doc["errors"]
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert {r["status"] for r in rows} == {"200"}
    assert counted >= 1, "nothing was preempted: the burst did not land on the backlog"
    assert doc["server"]["preemptions"] == counted == doc["policies"]["http"]["points"][0]["preemptions"]
    assert doc["server"]["preemptions_by_class"].get("batch<-interactive", 0) >= 1
    assert f"preemptions (the server's workers, during the run): {int(counted)}" in printed
    cpu = doc["server"]["cpu"]  # where the workers' CPU went meanwhile (engine/core/thread_cpu.py)
    assert cpu["compute_s"] > 0 and cpu["serving_s"] > 0 and 0 < cpu["serving_share"] < 1, cpu
    assert "the workers' CPU: " in printed
    batch = next(r for r in doc["per_class"] if r["slo_class"] == "batch")
    # (how many backlog requests make their 6 s target is the machine's load: none of 10 in one run of
    # the suite in two processes, where the other one likely ran the peer benchmark's busy processes)
    assert batch["requests"] == 10 and batch["failed"] == 0, batch
    # the per-class table, printed to a pipe, whole: every column on the header's one line
    header = next(line for line in printed.splitlines() if "target ms" in line)
    assert all(col in header for col in ("requests", "attainment", "TTFT p50 ms", "TTFT p99 ms", "TBT p99 ms"))
