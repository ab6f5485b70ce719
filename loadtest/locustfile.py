"""Locust against an OpenAI-compatible endpoint (the FlowPrefill gateway, or any other), open loop.

    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --load-profile burst
    .venv/bin/flowprefill loadtest --profile burst --host http://127.0.0.1:8000      # the same, headless

Arrivals come from a profile's schedule, not from response times: a pacer shared by the users of a
process hands out the next arrival and its due time; a free user sleeps until then and sends it.
With several Locust workers, worker k of n sends arrivals k, k+n, … from a start time the master
broadcasts. TTFT is the first streamed event carrying a choice, TBT the gaps between such events.
Locust's stats are named per SLO class (`POST` end to end, `TTFT`, `TBT`); a "SLO" tab in the web UI
shows attainment per class; at the end the master writes goodput.json, requests.csv and a PNG, with
the preemptions the server's FlowPrefill workers counted meanwhile (loadtest/server.py).

Users are the bound on requests in flight (`--max-in-flight` per process, or the web UI's "Number
of users"), all started before the first arrival is due.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import gevent
import requests
from locust import HttpUser, LoadTestShape, constant, events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from engine.protocol.headers import REQUEST_ID_HEADER, SLO_CLASS_HEADER
from loadtest import results
from loadtest.priority import ORDERS, class_priorities
from loadtest.profiles import Profile, ProfileError, Schedule, load_profile
from loadtest.server import ServerCounters
from loadtest.workload import prefixed_prompt, synthesize_prompt

log = logging.getLogger("flowprefill.loadtest")
LAG_WARN_S = 0.05
# Locust warns of spawn rates above 100 users/s per process (runners.py); this is the fastest it
# does not warn of, so 128 users take 1.3 s to start, and the schedule starts once they have.
SPAWN_RATE = 100.0


class Pacer:
    """Hands out this process's share of the schedule at its due times (open loop)."""

    def __init__(self, schedule: Schedule) -> None:
        self.arrivals = [r.arrival_s for r in schedule.workload.requests]
        self.t0: float | None = None
        self.next = 0
        self.stride = 1
        self.warned = False

    def start(self, t0: float, index: int, workers: int) -> None:
        self.t0, self.next, self.stride = t0, index, max(1, workers)

    def take(self) -> tuple[int, float] | None:
        """(schedule index, due unix time) once due; None when this process's share is sent."""
        while self.t0 is None:  # the master's start time has not arrived yet
            gevent.sleep(0.05)
        i = self.next
        if i >= len(self.arrivals):
            return None
        self.next += self.stride  # claimed before sleeping: gevent switches only at the sleep
        due = self.t0 + self.arrivals[i]
        delay = due - time.time()
        if delay > 0:
            gevent.sleep(delay)
        lag = time.time() - due
        if lag > LAG_WARN_S and not self.warned:
            self.warned = True
            log.warning("load generator fell behind the schedule by %.0f ms at request %d: raise the users "
                        "(--max-in-flight per process, or the web UI's number of users) or add Locust workers",
                        lag * 1000, i)
        return i, due


class Run:
    """This process's view of the run: the profile, its schedule and the records collected."""

    profile: Profile
    schedule: Schedule
    pacer: Pacer
    model: str = ""
    records: dict[int, results.Record]
    pending: list[results.Record]  # a worker's records not yet reported to the master
    started_at: float = 0.0
    last_arrival_at: float = 0.0
    server: ServerCounters | None = None

    def setup(self, env: Environment) -> None:
        opts = env.parsed_options
        self.profile = load_profile(opts.load_profile)
        self.schedule = self.profile.schedule()
        self.pacer = Pacer(self.schedule)
        self.records, self.pending = {}, []
        self.is_worker = isinstance(env.runner, WorkerRunner)
        self.priorities = class_priorities(opts.send_priority) if opts.send_priority else {}
        # Prompts differ from run to run: a server with prefix caching must not find the last run's
        # prompts (the traces give token counts only; no request shares a prefix with another).
        self.nonce = os.urandom(8).hex()

    def record(self, rec: results.Record) -> None:
        if self.is_worker:
            self.pending.append(rec)
        else:
            self.records[rec.index] = rec

    @property
    def done(self) -> bool:
        return len(self.records) >= len(self.schedule)


RUN = Run()


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--load-profile", default="steady", include_in_web_ui=True,
                        help="steady | ramp | burst | azure, or a profile TOML file")
    parser.add_argument("--max-in-flight", type=int, default=128, include_in_web_ui=False,
                        help="users per load-generating process: the most requests it keeps in flight "
                             "(the web UI's number of users, for all processes together)")
    parser.add_argument("--drain-s", type=float, default=120.0,
                        help="after the last arrival, how long to wait for answers before stopping")
    parser.add_argument("--flowprefill-out", default="", help="write goodput.json, requests.csv and a PNG here")
    parser.add_argument("--label", default="http", help="the name this run gets in goodput.json's policies")
    parser.add_argument("--send-priority", default="", choices=["", *ORDERS],
                        help="a plain OpenAI server: each class also as the body's `priority` (lower_first: vLLM's)")


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    try:
        RUN.setup(environment)
    except ProfileError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    _common_options(environment)
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        def plan(msg: Any, **_: Any) -> None:
            RUN.nonce = msg.data["nonce"]  # one run, one set of prompts (the shared prefixes alike)
            RUN.pacer.start(msg.data["t0"], runner.worker_index, msg.data["workers"])

        runner.register_message("flowprefill_plan", plan)
    if isinstance(runner, MasterRunner):
        environment.events.worker_report.add_listener(
            lambda client_id, data, **_: RUN.records.update(
                (r.index, r) for r in map(results.Record.from_wire, data.get("flowprefill", []))))
    if environment.web_ui:
        results.extend_web_ui(environment, RUN)


def _common_options(environment: Environment) -> None:
    """The users and spawn rate the web UI's form opens at (and a headless run uses) unless -u / -r
    name them: --max-in-flight per load-generating process, all started within about a second."""
    opts = environment.parsed_options
    if opts is None or opts.worker:
        return
    processes = max(1, opts.expect_workers if opts.master else 1)
    if opts.num_users is None:
        opts.num_users = opts.max_in_flight * processes
    if opts.spawn_rate is None:
        opts.spawn_rate = min(float(opts.num_users), SPAWN_RATE * processes)


@events.report_to_master.add_listener
def _report(client_id: str, data: dict[str, Any], **_: Any) -> None:
    data["flowprefill"] = [r.to_wire() for r in RUN.pending]
    RUN.pending = []


@events.test_start.add_listener
def _start(environment: Environment, **_: Any) -> None:
    runner = environment.runner
    if not RUN.model:  # the name the server serves: any OpenAI-compatible server wants one
        try:
            RUN.model = requests.get(f"{environment.host}/v1/models", timeout=10).json()["data"][0]["id"]
        except Exception as exc:
            log.warning("GET %s/v1/models failed (%s): requests will name no model", environment.host, exc)
    if isinstance(runner, WorkerRunner):
        return  # the master's plan message starts the pacer
    RUN.records, RUN.started_at = {}, time.time()
    RUN.server = ServerCounters(environment.host or "")
    opts = environment.parsed_options
    spawn_s = opts.num_users / opts.spawn_rate if opts.num_users and opts.spawn_rate else 0.0
    if isinstance(runner, MasterRunner):
        t0 = time.time() + max(2.0, spawn_s)  # time for the workers to receive the plan and spawn their users
        runner.send_message("flowprefill_plan", {"t0": t0, "workers": runner.worker_count, "nonce": RUN.nonce})
    else:
        t0 = time.time() + max(0.5, spawn_s)
    RUN.pacer.start(t0, 0, 1)
    RUN.last_arrival_at = t0 + RUN.schedule.workload.duration_s


@events.test_stop.add_listener
def _stop(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or not environment.parsed_options.flowprefill_out:
        return
    out = Path(environment.parsed_options.flowprefill_out)
    preempted, cpu = RUN.server.stop() if RUN.server else (None, None)
    doc = results.write(out, RUN.profile, RUN.schedule, RUN.records, environment.host or "", RUN.model,
                        environment.parsed_options.label, preempted, cpu)
    log.info("wrote %s: %s", out / "goodput.json", json.dumps(doc["accounting"]))


class OpenAIUser(HttpUser):
    """Sends the schedule's requests, streaming, and measures TTFT and TBT per SLO class."""

    wait_time = constant(0)

    @task
    def send_next(self) -> None:
        item = RUN.pacer.take()
        if item is None:
            gevent.sleep(1.0)  # this process's share is sent; the shape ends the run
            return
        i, due = item
        tr = RUN.schedule.workload.requests[i]
        p = RUN.profile
        rec = results.Record(index=i, slo_class=tr.slo_class, input_tokens=tr.input_tokens,
                             scheduled_s=tr.arrival_s, lag_s=max(0.0, time.time() - due))
        try:
            self._stream(tr.slo_class, i, tr.input_tokens, min(p.max_tokens, tr.output_tokens or p.max_tokens), rec,
                         tr.prefix)
        except BaseException as exc:  # GreenletExit when the run stops: still accounted for
            rec.error = rec.error or f"interrupted: {type(exc).__name__}"
            raise
        finally:
            RUN.record(rec)

    def _stream(self, cls: str, i: int, n_in: int, n_out: int, rec: results.Record,
                prefix: tuple[int, ...] = ()) -> None:
        p = RUN.profile
        # A chat message is text: printable ASCII (ids 32-126), one token a byte for the embedded model's
        # byte tokenizer; random bytes up to 255 are not UTF-8 (a 3,000-byte prompt never decodes).
        ids = 127 if p.endpoint == "chat" else 256
        if prefix:  # a trace naming its prompts' blocks (Mooncake's hash ids): they share what the ids share
            prompt_ids = prefixed_prompt(prefix, n_in, ids, salt=f"{RUN.nonce}-")
        else:
            shared = []  # the start of the prompt that other requests share (a system prompt, a document)
            if p.shared_prefix_tokens:
                shared = synthesize_prompt(min(n_in, p.shared_prefix_tokens), ids,
                                           seed=f"{RUN.nonce}-shared-{i % p.shared_prefixes}")
            prompt_ids = shared + synthesize_prompt(n_in - len(shared), ids, seed=f"{RUN.nonce}-{i}")
        body: dict[str, Any] = {"model": RUN.model or None, "max_tokens": n_out, "stream": True,
                                "temperature": 0, "ignore_eos": True, "priority": RUN.priorities.get(cls)}
        if RUN.profile.endpoint == "chat":
            text = bytes(prompt_ids).decode("ascii")
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        else:
            path, body["prompt"] = "/v1/completions", prompt_ids
        headers = {SLO_CLASS_HEADER: cls, REQUEST_ID_HEADER: f"lt-{int(RUN.started_at)}-{i}"}
        t_send = time.time()
        last = None
        with self.client.post(path, json={k: v for k, v in body.items() if v is not None}, headers=headers,
                              stream=True, catch_response=True, name=cls) as resp:
            rec.status = resp.status_code
            rec.applied_class = resp.headers.get(SLO_CLASS_HEADER, "")
            if resp.status_code == 0:  # no HTTP answer: Locust keeps requests' exception
                rec.error = results.no_answer(getattr(resp, "error", None))
            elif resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {resp.text[:1000]}"  # an OpenAI error body whole
            else:
                done = False
                for line in resp.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = f"stream error: {event['error'].get('message', '')}"
                        break
                    if event.get("choices"):
                        now = time.time()
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t_send
                            self._sample("TTFT", cls, rec.ttft_s)
                        else:
                            rec.gaps_s.append(now - last)
                        last = now
                if not done and rec.error is None:
                    rec.error = "stream ended without [DONE]"
            rec.e2e_s = time.time() - t_send
            if rec.gaps_s:
                self._sample("TBT", cls, sum(rec.gaps_s) / len(rec.gaps_s))
            resp.request_meta["response_time"] = rec.e2e_s * 1000  # end to end, not time to headers
            if rec.error:
                resp.failure(rec.error)
            else:
                resp.success()

    def _sample(self, kind: str, cls: str, seconds: float) -> None:
        self.environment.events.request.fire(request_type=kind, name=cls, response_time=seconds * 1000,
                                             response_length=0, exception=None, context={})


class ScheduleShape(LoadTestShape):
    """The users (the in-flight bound) from the start, at the spawn rate of the command line or the
    web UI's form; ends the run once every scheduled request has an answer (or the drain time after
    the last arrival has passed). The profile, not the users, decides when requests arrive."""

    use_common_options = True  # the form shows (and takes) the users and spawn rate this shape runs

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options
        users = opts.num_users or opts.max_in_flight * (getattr(self.runner, "worker_count", 0) or 1)
        spawn_rate = opts.spawn_rate or min(float(users), SPAWN_RATE)
        if RUN.started_at and RUN.done:
            return None
        if RUN.last_arrival_at and time.time() > RUN.last_arrival_at + opts.drain_s:
            log.warning("drain time over: %d of %d requests unanswered", len(RUN.schedule) - len(RUN.records),
                        len(RUN.schedule))
            return None
        return users, spawn_rate
