"""Upstream workers: their state, the pool's members, and the choice of where a request goes (their
health checks and load polls: gateway/polling.py)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Collection
from urllib.parse import urlsplit

import httpx

from gateway.affinity import Prefix, PrefixTable
from gateway.config import Discovery as DiscoverySettings
from gateway.config import Upstream
from gateway.discovery import Discovery, split_sources
from gateway.late import LateGate, Lateness, ServiceTimes
from gateway.polling import WorkerPolling

log = logging.getLogger("flowprefill.gateway")


class Worker:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.address = urlsplit(self.url).netloc  # host:port ([v6]:port), as an endpoint picker names it
        self.healthy = True
        self.checked = True  # a health check passed once (False for a member that joined: traffic only then)
        self.in_flight = 0
        self.tokens_in_flight = 0  # gated: prompt tokens of its requests still in prefill (`WorkerPool.charge`)
        self.backlog_s = 0.0  # predicted prefill work queued there (its /load)
        self.down_until = 0.0
        self.errors = 0  # consecutive 5xx answers (`WorkerPool.record_error`)
        self.role = ""  # what the worker says it does (its /load): colocated, prefill or decode
        self.backlog_by_class: dict[str, float] = {}  # its waiting requests' predicted prefill s, per class
        self.problems_logged: set[str] = set()  # the reasons logged since it last passed (each once)

    def __repr__(self) -> str:
        return f"Worker({self.url}, healthy={self.healthy}, in_flight={self.in_flight})"

    def live(self, now: float) -> bool:
        """In rotation at `now`: healthy, and past any cool-down after a failure."""
        return self.healthy and self.down_until <= now


class QueueFull(Exception):
    pass


# (latest start, seq, workers excluded, prefix, tokens charged, may backfill, the waiter's future)
Waiting = tuple[float, int, frozenset[str], "Prefix | None", int, bool, "asyncio.Future[Worker]"]


class WorkerPool(WorkerPolling):
    """SLO-aware routing: least predicted backlog (the worker's own /load plus what this gateway
    has in flight there), round robin among equals; a failing worker leaves rotation until its
    health check passes again (`WorkerPolling`, gateway/polling.py).

    In front of plain OpenAI servers (`upstream.kind = "openai"`), which serve first come first
    served, the pool is also a gate: at most `max_concurrency` requests run on each server (and,
    with `max_tokens_in_flight`, at most that many prompt tokens in prefill there) and the rest wait
    here by latest start (slack-based EDF, gateway/late.py), so an urgent request overtakes the queued ones."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient, poll_s: float = 1.0,
                 per_request_s: float = 0.05, upstream: Upstream | None = None,
                 roles: frozenset[str] = frozenset({"colocated"}), affinity_slack_s: float = 0.25,
                 discovery: DiscoverySettings | None = None) -> None:
        """`urls`: worker base URLs, and `dns:NAME:PORT` sources whose addresses are the workers
        (gateway/discovery.py, looked up as `discovery` says).
        `roles`: the worker roles this pool's job needs; a worker declaring another stays out.
        `affinity_slack_s`: how much more predicted backlog than the least loaded worker a request's
        prefix worker may have and still get it (gateway/affinity.py)."""
        if not urls:
            raise ValueError("the gateway needs at least one worker URL")
        static, targets = split_sources(urls)
        self.workers = [Worker(u) for u in static]
        # Members that left (their DNS record went) with requests still in flight: they finish, get no more.
        self.draining: dict[str, Worker] = {}
        self.joined = self.left = 0  # members added and removed since start (metrics)
        self.discovery = Discovery(static, targets, discovery or DiscoverySettings()) if targets else None
        self.client, self.poll_s, self.per_request_s = client, poll_s, per_request_s
        self.upstream = upstream or Upstream()
        self.gated = self.upstream.kind == "openai"
        self.roles = roles
        self.affinity_slack_s = affinity_slack_s
        # Where this pool's requests' prefixes are cached (gateway/affinity.py): the caller records a
        # worker once it has answered 200, so a worker that shed or failed a request never takes its keys.
        self.prefixes = PrefixTable()
        self._rr = itertools.count()
        self._seq = itertools.count()
        self._waiting: list[Waiting] = []
        self.late = LateGate()  # waiters that can no longer make their deadline (counted: metrics)
        self.service = ServiceTimes()  # dispatch to first token, by prompt size: a waiter's slack
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def queued(self) -> int:
        return sum(not f.done() for *_, f in self._waiting)

    @property
    def charges_tokens(self) -> bool:
        """Does a request's prompt count here (a gated pool with a token budget)?"""
        return self.gated and self.upstream.max_tokens_in_flight > 0

    def charge(self, prompt_tokens: int) -> int:
        """What a request of `prompt_tokens` counts against a gated server's token budget: all of it, up
        to the budget less its reserve for shorter prompts (`Upstream.reserve_tokens`: a long prompt runs
        in several steps, and shorter ones join its last); nothing when no budget is set or the workers
        schedule themselves."""
        return min(max(prompt_tokens, 1), self.upstream.long_prompt_charge) if self.charges_tokens else 0

    async def acquire(self, deadline: float, exclude: frozenset[str] | set[str] = frozenset(),
                      key: Prefix | None = None, late: Lateness | None = None, tokens: int = 0,
                      prompt_tokens: int = 0, streamed: bool = False) -> Worker | None:
        """A worker for this request, counted in flight there (give it back with `release`).
        None when no healthy worker is left to try. Gated: waits its turn by its latest start (its
        deadline less the service time seen for `prompt_tokens`, `ServiceTimes`), and once that has
        passed while it waits, as its class's `late` says (`LateGate`).
        `key`: the request's prefix key (gateway/affinity.py), if it has one. `tokens`: its
        `charge`, held against the worker's token budget until `release` or `prefilled`. `streamed`:
        it gives its tokens back at its first token, so it may backfill (`_backfills`)."""
        exclude = frozenset(exclude)
        if not self.gated:
            w = self.pick(exclude, key)
            if w is not None:
                w.in_flight += 1
            return w
        if self.pick(exclude) is None:
            return None
        if not self.queued and (w := self._free(exclude, key, tokens)) is not None:
            self._take(w, tokens)
            return w
        if self.queued >= self.upstream.max_queue:
            raise QueueFull
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.late.track(fut, deadline, late)
        start_by = deadline - self.service.estimate(prompt_tokens) if self.upstream.slack == "observed" else deadline
        heapq.heappush(self._waiting, (start_by, next(self._seq), exclude, key, tokens, streamed, fut))
        if tokens:
            self._dispatch()  # ahead of a waiter too long for the room left, it may fit now
        try:
            return await fut
        except asyncio.CancelledError:  # the client went away while queued (or just as it got a slot)
            if fut.done() and not fut.cancelled():
                self.release(fut.result(), tokens)
            fut.cancel()
            raise

    @staticmethod
    def _take(w: Worker, tokens: int) -> None:
        w.in_flight += 1
        w.tokens_in_flight += tokens

    def prefilled(self, w: Worker, tokens: int) -> None:
        """A request's first token came from `w`: its `tokens` no longer count against the budget
        there (decoding it costs the server a token a step), and a waiter may take them."""
        if tokens:
            w.tokens_in_flight -= tokens
            self._dispatch()

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        """A streamed request of `prompt_tokens` had its first token `seconds` after it was dispatched."""
        if self.gated:
            self.service.observe(prompt_tokens, seconds)

    def release(self, w: Worker, tokens: int = 0) -> None:
        """`w`'s request is done; `tokens`: what it still holds of its `charge` there."""
        w.in_flight -= 1
        w.tokens_in_flight -= tokens
        if w.in_flight == 0 and self.draining.get(w.url) is w:
            del self.draining[w.url]
            log.info("worker %s drained: its last request in flight is done", w.url)
        if self.gated:
            self._dispatch()

    def set_members(self, wanted: dict[str, str]) -> list[Worker]:
        """The pool's workers become `wanted` ({URL: where it comes from, for the log}). A new one
        takes traffic once a health check passes; one that left gets no new request and finishes
        those in flight (`draining` until then). Returns the new members, to be checked now."""
        keep = [w for w in self.workers if w.url in wanted]
        for w in self.workers:
            if w.url not in wanted:
                if w.in_flight:
                    self.draining[w.url] = w
                log.info("worker %s left the pool: %s", w.url, f"finishing its {w.in_flight} request(s) in flight, "
                         "no new ones" if w.in_flight else "nothing in flight")
        self.left += len(self.workers) - len(keep)
        present = {w.url for w in keep}
        joined = []
        for url, source in wanted.items():
            if url in present:
                continue
            w = self.draining.pop(url, None)  # back before it drained: its requests in flight still count
            if w is None:
                w = Worker(url)
                w.healthy, w.checked = False, False
            log.info("worker %s joined the pool (%s)", url, source)
            joined.append(w)
        self.joined += len(joined)
        self.workers = keep + joined
        return joined

    async def discover(self) -> None:
        """Look the DNS sources up again and take the changes in; new members are checked at once."""
        if self.discovery is None:
            return
        joined = self.set_members(await self.discovery.members())
        await asyncio.gather(*(self._check(w) for w in joined))
        if self.gated:
            self._dispatch()

    def _free(self, exclude: frozenset[str], key: Prefix | None = None, tokens: int = 0,
              spare_slot: bool = False) -> Worker | None:
        """A live worker with a free slot and room for `tokens` (an idle one always has room);
        `spare_slot`: with a slot left over after this one (a backfill must not take a holder's last)."""
        now, budget = time.monotonic(), self.upstream.max_tokens_in_flight
        cap = self.upstream.max_concurrency - (1 if spare_slot else 0)
        live = [w for w in self.workers if w.url not in exclude and w.healthy and w.down_until <= now]
        free = [w for w in live if w.in_flight < cap
                and (not tokens or not w.in_flight or w.tokens_in_flight + tokens <= budget)]
        if not free:
            return None
        if key is not None:
            if (home := self.prefixes.home(key, live)) in free:
                return home  # a slot on the prefix's worker; when it is full, any free one
            key.matched_chars = 0
        return min(free, key=lambda w: w.in_flight)

    def _dispatch(self) -> None:
        """Hand free slots to waiters, earliest latest start first; a waiter whose latest start has
        passed goes by its late bound instead, or is shed (`LateGate`). A waiter too long for the room its
        workers have left holds those workers back for itself (strict order: shorter prompts behind
        it must not starve it); later waiters may still take the others, and the room it cannot use
        yet as `_backfills` says."""
        now = time.monotonic()
        self._waiting = self.late.rekey(self._waiting, now)
        later = []
        held: set[str] = set()  # workers kept for an earlier waiter's prompt
        reserved_until = math.inf  # by when the waiters holding them must start (now: one is late already)
        while self._waiting:
            item = heapq.heappop(self._waiting)
            start_by, _, exclude, key, tokens, streamed, fut = item
            if fut.done():
                continue
            w = self._free(exclude | held, key, tokens)
            if w is None and held and streamed and self._backfills(tokens, now, reserved_until):
                w = self._free(exclude, key, tokens, spare_slot=True)
            if w is None:
                later.append(item)
                if tokens:
                    held |= {x.url for x in self.workers if x.url not in exclude}
                    reserved_until = min(reserved_until, now if self.late.is_late(fut) else start_by)
                if self._free(frozenset()) is None or (self._free(frozenset(held)) is None
                                                       and reserved_until <= now):
                    break  # no slot anywhere, or none outside those held and no room of theirs to lend
                continue
            self._take(w, tokens)
            fut.set_result(w)
        for item in later:
            heapq.heappush(self._waiting, item)

    def _backfills(self, tokens: int, now: float, reserved_until: float) -> bool:
        """May a streamed waiter of `tokens` (its charge) take room that an earlier waiter, too long for
        it, holds (EASY backfilling, with that waiter's latest start as its reservation)? Only a prompt
        shorter than a long one's charge, of a size seen often enough to have a time to first token,
        expected back by the high quantile of that time before the holder must start, and never ahead
        of a holder that is late already. Measured in front of vLLM at 14 req/s (azure-mix, 2,048-token
        budget): in strict order someone waited at the gateway 46 % of the time, three quarters of it
        with 512 tokens or more of the budget unused."""
        if not self.upstream.backfill or not 0 < tokens < self.upstream.long_prompt_charge:
            return False
        back_in = self.service.estimate(tokens, ServiceTimes.HIGH_QUANTILE)
        return back_in > 0 and now + back_in <= reserved_until

    def any_live(self) -> bool:
        """Whether any worker is in rotation, without taking a turn of the round robin among equals
        (`pick` takes one: asked before each request's own pick, two workers' turns always fell to the
        same one, and sent one at a time, every request went there)."""
        now = time.monotonic()
        return any(w.live(now) for w in self.workers)

    def pick(self, exclude: frozenset[str] | set[str] = frozenset(), key: Prefix | None = None) -> Worker | None:
        ranked = self.ranked(exclude, key)
        return ranked[0] if ranked else None

    def ranked(self, exclude: Collection[str] = frozenset(), key: Prefix | None = None,
               among: Collection[str] | None = None) -> list[Worker]:
        """The live workers (only those whose address is in `among`, if given) in the order this pool
        would try them: the request's choice first (its prefix's worker, unless load wins), then the
        others by predicted backlog, round robin among equals."""
        now = time.monotonic()
        live = [w for w in self.workers if w.url not in exclude and w.live(now)
                and (among is None or w.address in among)]
        if not live:
            return []
        start = next(self._rr)
        order = sorted(range(len(live)), key=lambda i: (self._score(live[i]), (i - start) % len(live)))
        ranked = [live[i] for i in order]
        if key is not None:
            home = self.prefixes.home(key, live)
            if home is not ranked[0] and self._score(home) <= self._score(ranked[0]) + self.affinity_slack_s:
                ranked.remove(home)
                ranked.insert(0, home)
            elif home is not ranked[0]:
                key.matched_chars = 0  # load wins: what was found is not where it goes
        return ranked

    def _score(self, w: Worker) -> float:
        return w.backlog_s + w.in_flight * self.per_request_s

    def mark_failed(self, w: Worker, cooldown_s: float = 2.0) -> None:
        log.warning("worker %s failed; out of rotation", w.url)
        w.healthy = False
        w.down_until = time.monotonic() + cooldown_s
        w.errors = 0

    # A 5xx answer is evidence against the worker only when it repeats: one request that trips a
    # bug fails the same way everywhere, and ejecting each worker it visits would take the fleet down.
    ERRORS_TO_EJECT = 3

    def record_error(self, w: Worker) -> None:
        w.errors += 1
        if w.errors >= self.ERRORS_TO_EJECT:
            self.mark_failed(w)

    def reported(self, w: Worker, backlog_s: float) -> None:
        """`w`'s answer reported its predicted backlog once it had admitted the request (its ORCA load
        report, engine/protocol/worker.py): fresher than the last poll, it ranks `w` until the next."""
        w.backlog_s = backlog_s

    def record_ok(self, w: Worker) -> None:
        w.errors = 0
