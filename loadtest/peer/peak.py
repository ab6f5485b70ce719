"""The machine's measured matmul peak, for the raw mode's "share of peak": a large square matmul in the
given dtype on the given threads (loadtest/flops.py's), in a process pinned where the servers run.

    python -m loadtest.peer.peak --dtype bfloat16 --threads 1 --size 2048
"""

from __future__ import annotations

import argparse
import json
import sys


def matmul_gflops(dtype: str, threads: int, size: int = 2048, repeats: int = 5) -> float:
    import torch

    from loadtest.flops import matmul_peak

    torch.set_num_threads(threads)
    return matmul_peak(getattr(torch, dtype), "cpu", size, repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.peer.peak", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(json.dumps({"gflops": matmul_gflops(args.dtype, args.threads, args.size, args.repeats),
                      "size": args.size, "dtype": args.dtype, "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
