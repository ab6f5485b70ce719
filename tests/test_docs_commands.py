"""The commands the Quickstart and the README tell a new user to run, run verbatim against a real
`flowprefill serve` (only the ports are moved to free ones)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from processes import free_port, start, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / doc).read_text(), re.S)


@contextmanager
def serve(*args: str) -> Iterator[int]:
    port = free_port(span=2)
    proc = start("serve", "--port", str(port), "--threads", "1", *args)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=240)
        yield port
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """`flowprefill serve` as the docs start it: the default model, SmolLM2 (with a KV cache of 16K tokens,
    its default's 262K being 12 GB)."""
    with serve("--kv-capacity-tokens", "16384") as port:
        yield port


def moved(text: str, port: int) -> str:
    text = re.sub(r"(127\.0\.0\.1|localhost):8001", rf"\g<1>:{port + 1}", text)
    text = re.sub(r"(127\.0\.0\.1|localhost):8000", rf"\g<1>:{port}", text)
    return text.replace(".venv/bin/", f"{VENV_BIN}/")


def run(cmd: str, port: int, timeout: float = 120) -> str:
    done = subprocess.run(["bash", "-c", moved(cmd, port)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["docs/quickstart.md", "README.md", "docs/engine.md"])
def test_curl_commands(port: int, doc: str) -> None:
    cmds = [b for b in blocks(doc, "bash") if b.lstrip().startswith("curl")]
    assert cmds, f"no curl commands in {doc}"
    for block in cmds:
        for cmd in re.split(r"\n(?=curl)", block.strip()):
            out = run(cmd, port)
            assert out.strip(), cmd
            if "-si" not in cmd and "-sN" not in cmd and "/metrics" not in cmd:
                # plain curl prints a JSON body (whole: the random model's text may hold any character,
                # a "#" too, which splitting the output on it once cut inside a string)
                json.loads(out)
            if "/metrics" in cmd:
                assert "flowprefill_" in out
            if "stream" in cmd:
                assert out.rstrip().endswith("data: [DONE]")


@pytest.mark.slow
def test_python_snippets(port: int) -> None:
    code = blocks("docs/quickstart.md", "python")
    assert len(code) == 4
    out = subprocess.run([sys.executable, "-c", moved("\n".join(code), port)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(line.startswith("batch ") for line in out.stdout.splitlines())  # the class applied
    assert any(line.startswith("up=") for line in out.stdout.splitlines())  # the structured answer, parsed
    assert any(line.startswith("incomplete 8 ") for line in out.stdout.splitlines())  # the Responses API's


@pytest.mark.slow
def test_quickstart_load_test(port: int, tmp_path: Path) -> None:
    from loadtest.profiles import BUILTIN

    (cmd,) = [b.strip() for b in blocks("docs/quickstart.md", "bash") if "flowprefill loadtest" in b]
    out = run(f"cd {tmp_path} && {cmd}", port, timeout=300)  # `serve` with its default model, as the docs say
    n = len(BUILTIN["burst"].schedule())  # 36 before the backlog was sized to be feasible on slow machines
    m = re.search(r"accounting: scheduled (\d+) = sent (\d+) \+ missing 0; sent = succeeded (\d+) \+ failed (\d+)",
                  " ".join(out.split()))
    assert m and int(m[1]) == int(m[2]) == n == int(m[3]) + int(m[4]), out[-3000:]
    # Every request ends answered, or (batch is sheddable) refused on a predicted miss of its 6 s, as the
    # docs say a busy machine may; nothing else fails, and no interactive request is refused.
    doc = json.loads((tmp_path / "bench-results/loadtest/goodput.json").read_text())
    shed = doc["errors"].get("HTTP 429 predicted_slo_miss", 0)
    assert sum(doc["errors"].values()) == shed == int(m[4]), doc["errors"]
    assert {c["slo_class"]: c["failed"] for c in doc["per_class"]}["interactive"] == 0, doc["per_class"]
    assert re.search(r"preemptions \(the server's workers, during the run\): [1-9]", out), out[-2000:]
    assert (tmp_path / "bench-results/loadtest/goodput.json").exists()
