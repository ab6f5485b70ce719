"""The project stands alone: nothing in it reads a folder beside the checkout (such as the workplace's shared one), so a
user's clone works as it is. `.ci/run` runs the suite in a copy with nothing beside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A relative path up and into the shared folder, or one built from the checkout's parent (parents[2] and the like).
OUTSIDE = re.compile(r"\.\./shared|parents\[\d\]\s*/\s*\"shared\"|parent\.parent\s*/\s*\"shared\"")


def test_no_file_reads_beside_the_checkout() -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True)
    files = listed.stdout.split() if listed.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                                                                  if ".venv" not in p.parts]
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".toml", ".md", ".yml", ".yaml", ""} or not path.is_file():
            continue
        if path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{name}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
