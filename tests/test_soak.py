"""A crowd through `flowprefill serve` on a KV cache far smaller than it needs: streams read to the
end, whole answers, stop strings with min_tokens, n choices, structured output, and clients that
leave mid-stream, all at once.
Answers are evicted and recomputed, requests wait for blocks; yet every request ends as a whole
answer or as cancelled (its client gone), the worker's counters say the same, and once the crowd
is gone the cache is whole and nothing waits or decodes. Whole answers equal the same requests'
answers on the idle worker afterwards."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import pytest
from processes import serving
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

KINDS = ("stream", "whole", "leave", "stop", "choices", "guided")
GUIDED = {"guided_regex": "[a-j ]{150,}"}  # a structured output that stays open past max_tokens
CLIENTS = 5 * len(KINDS)
TOKENS = 120  # per answer: 30 clients' prompts and answers want ~2.5x the 4,096-token cache


def _prompt(i: int) -> str:
    rng = random.Random(i)
    return "".join(rng.choice("abcdefghij ") for _ in range(rng.randrange(150, 300)))


def _client(url: str, i: int, outcome: dict[int, str], texts: dict[int, str], disaggregated: bool) -> None:
    kind = KINDS[i % len(KINDS)]
    body = {"model": "flowprefill-default", "prompt": _prompt(i), "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as http:
        if kind in ("whole", "guided"):
            r = http.post("/v1/completions", json=body | (GUIDED if kind == "guided" else {}))
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS
            outcome[i] = "length" if ok else f"bad {r.status_code} {r.text[:200]}"
            texts[i] = r.json()["choices"][0]["text"] if ok else ""
            if kind == "guided" and ok and not re.fullmatch("[a-j ]*", texts[i]):
                outcome[i] = f"bad: not what the structured output allows: {texts[i]!r}"
        elif kind == "choices" and disaggregated:  # refused by name there
            r = http.post("/v1/completions", json=body | {"n": 2})
            outcome[i] = "refused" if r.status_code == 400 and r.json()["error"]["param"] == "n" else r.text[:200]
        elif kind == "choices":  # greedy: both choices the same answer
            r = http.post("/v1/completions", json=body | {"n": 2})
            data = r.json()
            ok = (r.status_code == 200 and data["usage"]["completion_tokens"] == 2 * TOKENS
                  and data["choices"][0]["text"] == data["choices"][1]["text"])
            outcome[i] = "length" if ok else f"bad {r.status_code} {r.text[:200]}"
        elif kind == "stop":
            r = http.post("/v1/completions", json=body | {"stop": ["a"], "min_tokens": 20})
            data = r.json()
            ok = r.status_code == 200 and data["usage"]["completion_tokens"] >= 20
            outcome[i] = data["choices"][0]["finish_reason"] if ok else f"bad {r.status_code} {r.text[:200]}"
        else:
            lines = 0
            if kind == "leave":  # long enough that it cannot be over before the worker sees the client go
                body["max_tokens"] = 3500  # (its prompt and all of them must fit the 4,096-token cache)
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                if r.status_code != 200:
                    outcome[i] = f"bad {r.status_code} {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    lines += line.startswith("data: ")
                    if kind == "leave" and lines == 5:
                        break  # the client goes: the engine must cancel and free its blocks
                    if line == "data: [DONE]":
                        break
            outcome[i] = "cancelled" if kind == "leave" else ("length" if line == "data: [DONE]" and lines == TOKENS + 1
                                                              else f"bad stream of {lines} events")


def _metrics(worker: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{worker}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_a_crowd_on_a_small_cache_ends_whole_and_leaves_nothing_behind(disaggregated: bool) -> None:
    """Disaggregated, the decode worker's cache is the small one: hand-offs wait there for blocks,
    answers are evicted and recomputed there (their prompts were prefilled elsewhere)."""
    flags = ("--workers", "2", "--disaggregate") if disaggregated else ()
    with serving("--kv-capacity-tokens", "4096", "--kv-block-size", "16", *flags) as url:
        port = int(url.rsplit(":", 1)[1])
        worker = url.rsplit(":", 1)[0] + f":{port + (2 if disaggregated else 1)}"  # the decode worker
        outcome: dict[int, str] = {}
        texts: dict[int, str] = {}
        threads = [threading.Thread(target=_client, args=(url, i, outcome, texts, disaggregated))
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(outcome) == CLIENTS, "a client never got an answer"
        ends = ("length", "stop", "cancelled") + (("refused",) if disaggregated else ())
        assert all(o in ends for o in outcome.values()), sorted(outcome.items())
        served = CLIENTS - sum(o == "refused" for o in outcome.values())
        for w in {worker, url.rsplit(":", 1)[0] + f":{port + 1}"}:  # every worker (the prefill one too)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                load = httpx.get(f"{w}/load").json()
                if (load["waiting"], load["decoding"], load["kv_cache_usage"]) == (0, 0, 0.0):
                    break
                time.sleep(0.2)
            assert (load["waiting"], load["decoding"], load["kv_cache_usage"]) == (0, 0, 0.0), (w, load)
        m = _metrics(worker)
        finished: dict[str, float] = {}
        for (name, labels), v in m.items():
            if name == "flowprefill_requests_finished_total":
                reason = dict(labels)["finish_reason"]
                finished[reason] = finished.get(reason, 0) + v
        assert sum(finished.values()) == served and finished.get("cancelled") == CLIENTS // len(KINDS), finished
        assert not finished.get("error")
        evicted = sum(v for k, v in m.items() if k[0] == "flowprefill_decode_preemptions_total")
        assert evicted > 0, "the cache never ran short: the scenario did not happen"
        for i, text in texts.items():  # evicted, recomputed, cached or not: the answer alone on an idle worker
            guided = GUIDED if KINDS[i % len(KINDS)] == "guided" else {}
            alone = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": _prompt(i), "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True} | guided)
            assert alone.json()["choices"][0]["text"] == text, i
