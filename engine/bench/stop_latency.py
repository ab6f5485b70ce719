"""Section 3 of `flowprefill bench prefill`: preemption stop latency through the real engine.

A long `batch` request is prefilling when short urgent requests arrive at random moments; each
preemption records the time from the scheduler's decision to the batch actually stopping, with and
without the sub-operator split.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine.bench.prefill_plot import size_label
from engine.core.batch_log import host_gaps_ms
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.model.cost import SIZE_CLASSES, OpCost, SeqSpan
from engine.sim.oracle import BatchCostRecorder

STOP_TARGET_MS = 5.0  # what a preemption should cost at most (the line on the plot)
URGENT_PROMPT_TOKENS = 32
URGENT_TTFT_S = 0.25
LONG_TTFT_S = 3600.0  # the long request never becomes urgent itself
MIN_INJECTION_GAP_S = 0.02  # mean spacing of urgent arrivals within one long prefill


def percentile(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=float), q)) if samples else float("nan")


def random_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, min(vocab, 256), (n,), generator=gen).tolist()


def cost_dict(cost: OpCost) -> dict[str, Any]:
    return {"attn_in_s_per_row": cost.attn_in_s_per_row, "ffn_s_per_row": cost.ffn_s_per_row,
            "attn_s_per_pair": cost.attn_s_per_pair, "step_overhead_s": cost.step_overhead_s,
            "row_step_floor_s": cost.row_step_floor_s, "row_block_s": cost.row_block_s}


class StopLatencySection:
    """Mixed into the prefill benchmark, which provides these attributes."""

    console: Console
    progress: Progress
    plan: Any
    seed: int
    cfg: EngineConfig
    gen: torch.Generator

    def stop_latency(self) -> dict[str, Any]:
        sizes = self.plan.stop_sizes
        targets = {
            "split": {n: self.plan.stop_samples for n in sizes},
            "unsplit": {n: self.plan.stop_samples_unsplit_long if n >= 16384 else self.plan.stop_samples_unsplit
                        for n in sizes},
        }
        task = self.progress.add_task("stop latency", total=sum(sum(t.values()) for t in targets.values()))
        rng = random.Random(self.seed)
        out: dict[str, Any] = {"sizes": list(sizes), "target_ms": STOP_TARGET_MS, "policy": "flowprefill",
                               "urgent_prompt_tokens": URGENT_PROMPT_TOKENS, "urgent_ttft_target_s": URGENT_TTFT_S,
                               "long_ttft_target_s": LONG_TTFT_S, "modes": {}}
        for mode, preemptible in (("split", True), ("unsplit", False)):
            self.progress.update(task, description=f"stop latency: engine start ({mode})")
            engine = Engine(replace(self.cfg, preemptible=preemptible), policy="flowprefill")
            batches = BatchCostRecorder()
            engine.observers.append(batches)
            engine.start()
            per: dict[str, Any] = {"budget_s": engine.budget_s, "calibration": cost_dict(engine.cost)}
            try:
                self._warm_up(engine)
                batches.batches.clear()
                for n in sizes:
                    self.progress.update(task, description=f"stop latency {size_label(n)} {mode}")
                    per[str(n)] = self._stop_cell(engine, n, targets[mode][n], rng, task)
                # what the engine learned of its own speed, per batch size class (OpCost.observe)
                per["correction"] = {"size_classes": [*SIZE_CLASSES, None], "factor": list(engine.cost.class_scale),
                                     "batches": list(engine.cost.class_observations)}
                # the engine idle between batches while work waited (every urgent batch follows a preemption)
                per["host_gap_ms"] = host_gaps_ms(batches.batches)
            finally:
                engine.shutdown()
                del engine
                gc.collect()
            out["modes"][mode] = per
        self.progress.update(task, description="stop latency")
        self._stop_table(out)
        return out

    def _warm_up(self, engine: Engine) -> None:
        """One unmeasured prefill and one urgent request: first-touch costs stay out of the samples."""
        vocab = engine.model.cfg.vocab_size
        for i, (n, ttft) in enumerate(((2048, LONG_TTFT_S), (URGENT_PROMPT_TOKENS, URGENT_TTFT_S))):
            req, done = _request(f"bench-warmup-{i}", random_prompt(n, vocab, self.gen), "batch", ttft)
            engine.add_request(req)
            if not done.wait(120.0):
                raise RuntimeError("the engine did not finish a warm-up request")

    def _stop_cell(self, engine: Engine, n: int, target: int, rng: random.Random, task: Any) -> dict[str, Any]:
        """Prefill a long request again and again; while it runs, urgent requests arrive at random
        moments and each preemption it suffers is one sample. Once the samples are in (or the
        cell's time is up) the long request is cancelled rather than left to finish. A size past the
        model's context (SmolLM2's 8,192 tokens hold a prompt of 8,191 and its one token) runs at the longest."""
        vocab = engine.model.cfg.vocab_size
        n = min(n, engine.model.cfg.max_position_embeddings - 1)
        predicted_s = engine.cost.prefill_s([SeqSpan(0, n)])
        cell_end = time.monotonic() + self.plan.stop_cell_cap_s
        suspensions: list[dict[str, Any]] = []
        urgent_ttft: list[float] = []
        injected = long_runs = cancelled = 0
        long_wall: list[float] = []
        while len(suspensions) < target and (long_runs == 0 or time.monotonic() < cell_end):
            long_req, long_done = _request(f"bench-long-{n}-{long_runs}", random_prompt(n, vocab, self.gen),
                                           "batch", LONG_TTFT_S)
            long_runs += 1
            t0 = time.monotonic()
            engine.add_request(long_req)
            _wait_until(lambda r=long_req: r.times.prefill_start is not None or r.finish_reason is not None,
                        timeout=60.0)
            # Spread the wanted arrivals over what this prefill (or the cell's time) will last.
            want = target - len(suspensions)
            expected_s = max(long_wall) if long_wall else predicted_s
            span_s = min(expected_s, max(cell_end - time.monotonic(), MIN_INJECTION_GAP_S))
            gap = max(MIN_INJECTION_GAP_S, span_s / want)
            while not long_done.is_set() and len(suspensions) + len(long_req.times.suspensions) < target:
                if long_done.wait(rng.uniform(0.0, 2.0 * gap)) or time.monotonic() > cell_end:
                    break
                ids = random_prompt(URGENT_PROMPT_TOKENS, vocab, self.gen)
                urgent, urgent_done = _request(f"bench-urgent-{n}-{injected}", ids, "interactive", URGENT_TTFT_S)
                engine.add_request(urgent)
                injected += 1
                if not urgent_done.wait(60.0 + 10 * predicted_s):
                    raise RuntimeError(f"urgent request {urgent.request_id} did not finish")
                if urgent.ttft is not None:
                    urgent_ttft.append(urgent.ttft)
            if not long_done.is_set():  # sampling is over: don't sit out the rest of the prefill
                engine.cancel(long_req.request_id)
                cancelled += 1
            if not long_done.wait(120.0 + 20 * predicted_s):
                raise RuntimeError(f"long request of {n} tokens did not finish")
            if long_req.finish_reason == "error":
                raise RuntimeError(f"long request of {n} tokens failed in the engine")
            if long_req.finish_reason != "cancelled":
                long_wall.append(time.monotonic() - t0)
            new = [{"stop_ms": s.stop_latency_s * 1e3, "layer": s.layer, "operator": s.operator,
                    "tokens_done": s.tokens_done, "queued_steps": s.queued_steps,
                    "queued_predicted_ms": s.queued_predicted_s * 1e3} for s in long_req.times.suspensions]
            self.progress.advance(task, min(target, len(suspensions) + len(new)) - min(target, len(suspensions)))
            suspensions += new
        self.progress.advance(task, max(0, target - len(suspensions)))  # what the time cap left undone
        return {**_samples(suspensions, target, n), "injected": injected,
                "missed": injected - len(suspensions), "long_prefills": long_runs,
                "long_prefills_cancelled": cancelled, "long_prefill_wall_s": long_wall,
                "predicted_prefill_s": predicted_s, **_urgent(urgent_ttft)}

    def _stop_table(self, r: dict[str, Any]) -> None:
        t = Table(title=f"3 · Stop latency through the engine: preemption decided -> batch suspended "
                  f"(target {STOP_TARGET_MS:g} ms)", title_justify="left")
        t.add_column("prompt", justify="right")
        for mode in r["modes"]:
            for col in ("n", "p50 ms", "p99 ms", "max ms", "urgent TTFT p99"):
                t.add_column(f"{mode}\n{col}", justify="right")
        for n in r["sizes"]:
            row = [size_label(n)]
            for per in r["modes"].values():
                c = per[str(n)]
                ok = c["p99_ms"] <= STOP_TARGET_MS
                row += [str(c["n"]), f"{c['p50_ms']:.2f}", f"[{'green' if ok else 'red'}]{c['p99_ms']:.2f}[/]",
                        f"{c['max_ms']:.2f}", f"{c['urgent_ttft_p99_ms']:.0f} ms"]
            t.add_row(*row)
        self.console.print(t)
        for mode, per in r["modes"].items():
            if gap := per.get("host_gap_ms"):
                self.console.print(f"host gap ({mode}): median {gap['p50']:.3f} ms, p99 {gap['p99']:.3f} ms "
                                   f"over {gap['batches']} batches")


def _request(rid: str, ids: list[int], slo_class: str, ttft_s: float) -> tuple[Request, threading.Event]:
    done = threading.Event()
    req = Request(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1, temperature=0.0),
                  slo_class=slo_class, ttft_target_s=ttft_s)
    req.sink = lambda out, e=done: out.finish_reason and e.set()  # type: ignore[func-returns-value]
    return req, done


def _wait_until(cond: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError("timed out waiting for the engine")
        time.sleep(0.0005)


def _samples(suspensions: list[dict[str, Any]], target: int, n: int) -> dict[str, Any]:
    """A stop-latency cell's samples and their summary."""
    ms = [s["stop_ms"] for s in suspensions]
    return {"samples_ms": ms, "suspensions": suspensions, "n": len(ms), "target_n": target, "prompt_tokens": n,
            "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms) if ms else float("nan"),
            "within_target": (sum(x <= STOP_TARGET_MS for x in ms) / len(ms)) if ms else float("nan")}


def _urgent(ttft_s: list[float]) -> dict[str, Any]:
    """The urgent requests' TTFTs of a cell, ms, and their p50 and p99."""
    ms = [x * 1e3 for x in ttft_s]
    return {"urgent_ttft_ms": ms, "urgent_ttft_p50_ms": percentile(ms, 50), "urgent_ttft_p99_ms": percentile(ms, 99)}
