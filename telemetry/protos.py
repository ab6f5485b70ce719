"""Protobuf modules that another package overwrote, and putting them back.

xds-protos (Envoy's protos, which the `epp` extra needs: gateway/epp/) ships its own, older copies of
`opentelemetry.proto` and of googleapis-common-protos' `google.api` / `google.rpc` modules, and pip
lets whichever package it installs last own those files. When xds-protos comes last, the OTLP
exporters fail to import (`cannot import name 'InstrumentationScope'`: 1.85 ships a 2021 copy) and
tracing is lost. The picker needs none of the copies, so the fix is to reinstall the two owners, at
the versions installed, without their dependencies: `python -m telemetry.protos --repair`.

`replaced()` finds the damage the way pip would record it: each owner's files against the sha256 in
its RECORD, so it names a replaced module whatever package replaced it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution

OWNERS = ("opentelemetry-proto", "googleapis-common-protos")


def replaced(owners: tuple[str, ...] = OWNERS) -> dict[str, str]:
    """{distribution: version} of the installed owners whose modules on disk are not the ones they
    installed (a file missing or of another content)."""
    out: dict[str, str] = {}
    for name in owners:
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        for f in dist.files or []:
            if f.hash is None or f.hash.mode != "sha256" or not str(f).endswith(".py"):
                continue
            try:
                data = f.locate().read_bytes()
            except OSError:
                out[name] = dist.version
                break
            if base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode() != f.hash.value:
                out[name] = dist.version
                break
    return out


def repair_command(damaged: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps",
            *(f"{name}=={version}" for name, version in sorted(damaged.items()))]


def advice(damaged: dict[str, str]) -> str:
    """One line for the log: what is wrong and the command that mends it."""
    names = ", ".join(f"{n} {v}" for n, v in sorted(damaged.items()))
    return (f"the modules of {names} were replaced by other copies (xds-protos, of the epp extra, ships old "
            f"ones): restore them with `{sys.executable} -m telemetry.protos --repair`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m telemetry.protos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repair", action="store_true", help="reinstall the owners of replaced modules")
    args = parser.parse_args(argv)
    damaged = replaced()
    if not damaged:
        print("protobuf modules: as their packages installed them")
        return 0
    if not args.repair:
        print(advice(damaged))
        return 1
    subprocess.run(repair_command(damaged), check=True)
    still = replaced()
    print("protobuf modules: restored" if not still else advice(still))
    return 0 if not still else 1


if __name__ == "__main__":
    sys.exit(main())
