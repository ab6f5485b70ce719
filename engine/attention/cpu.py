"""FlowPrefill's own CPU kernels (engine/attention/cpu_flash.cpp): attention, decode attention on the paged
cache (cpu_decode.cpp), and the fused row kernels (RMSNorm, SiLU-and-mul, RoPE; engine/model/kernels.py),
built on first use.

Why our own: torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) runs this
engine's default model (head size 32, 4:1 grouped-query heads) at about 50 GFLOP/s on one AVX-512
core in bf16 and 58 in fp32 (8K-token causal tile), vLLM's CPU kernel at 57-67 and 68; this one at
106-130 and 78, by computing bf16 scores and P.V with AVX-512 BF16's dot-product instruction, reading
the keys of each KV head once for all the query heads that share it and skipping the causal
triangle's masked blocks. inductor's CPU flex attention was timed too:
17 GFLOP/s in bf16, and it cannot carry a split query block's softmax from one key tile to the next.

The kernel is compiled once per machine by torch's extension builder (g++ and ninja; about 25 s) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) and loaded from there
afterwards. It needs AVX-512 (and AVX-512 BF16 for bfloat16 models); where it cannot be built or
used, `load` says why and the engine keeps torch's SDPA backend.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import merge_lse
from engine.core.kv_cache import KVCache

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_flash.cpp", "cpu_rows.cpp", "cpu_decode.cpp")]
HEADER = Path(__file__).with_name("cpu_simd.h")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the head sizes the kernel is instantiated for
# -fopenmp: at::parallel_for is a `#pragma omp parallel` in ATen's headers, which a build without it
# compiles to one thread: the attention tile ran 34.7 ms at 2K tokens causal (fp32) on one thread and on
# two. The symbols resolve to the libgomp torch itself loaded (same soname), so torch.set_num_threads and
# the engine's core pinning govern these threads as they govern torch's own.
_BASE_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
_lock = threading.Lock()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _sources_digest() -> str:
    """The sources' and header's content, in the build's name: torch keeps one build per name and
    rebuilds it when its sources or flags change, so two installs of different versions on one machine
    (a checkout and a release, a benchmark's copy) would rebuild it, 20-70 s, each time the other ran."""
    digest = hashlib.sha256()
    for path in (*SOURCES, HEADER):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _no_stale_lock(build_dir: Path) -> Iterator[None]:
    """torch's builder marks a build in progress with a `lock` file, which a process that dies meanwhile
    (a Ctrl-C during a first start) leaves behind: every later start then waits for it without end. A
    flock of our own, which the OS releases with its process, tells a live builder from a dead one:
    holding it, no other FlowPrefill process is building, so a `lock` file there is stale."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "flowprefill.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live builder
        if (stale := build_dir / "lock").exists():
            log.warning("%s: removing the lock a stopped build left", stale)
            stale.unlink(missing_ok=True)
        yield


@cache
def build() -> tuple[frozenset[torch.dtype], str]:
    """Build (or load the cached build of) the kernel for this CPU: the dtypes it runs, and why
    none if it cannot be used here."""
    flags = cpu_flags()
    if not {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"} <= flags:
        return frozenset(), "needs a CPU with AVX-512 (avx512f/bw/dq/vl)"
    bf16 = "avx512_bf16" in flags
    name = f"flowprefill_attention_{'avx512bf16' if bf16 else 'avx512'}_{_sources_digest()}"
    cflags = _BASE_FLAGS + (["-mavx512bf16", "-DFLOWPREFILL_BF16=1"] if bf16 else [])
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        with _lock, _no_stale_lock(Path(_get_build_directory(name, verbose=False))):
            load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags,
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: torch's SDPA serves instead
        return frozenset(), f"could not be built ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300]})"
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32}), ""


def unsupported(dtype: torch.dtype, head_dim: int) -> str:
    """Why the kernel cannot run this model here ('' if it can); builds it on first call."""
    if head_dim not in HEAD_DIMS:
        return f"head size {head_dim} is not one it is built for {HEAD_DIMS}"
    return runs(dtype)


def runs(dtype: torch.dtype) -> str:
    """Why the kernels cannot run `dtype` here ('' if they can); builds them on first call."""
    dtypes, reason = build()
    if reason:
        return reason
    if dtype not in dtypes:
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        return f"runs {kinds} on this CPU, not {str(dtype).removeprefix('torch.')}"
    return ""


class _Ops:
    """The extension's operators, looked up once: `torch.ops.flowprefill.attention(...)` resolves its
    overload on every call, some 10 us each, and a long prefill calls it a thousand times."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = getattr(torch.ops.flowprefill, name).default
        setattr(self, name, op)
        return op


_ops = _Ops()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, q_heads, d] against k/v [m, kv_heads, d] (causal: bottom-right) -> out, lse [n, q_heads]."""
    return _ops.attention(q, k, v, causal)


class RunningTiles:
    """A block of queries' attention over key tiles, its online softmax carried from tile to tile in
    fp32 (the kernel's `Running` state): no tile's normalised result is written for a merge to read
    back, and tiles on 128-key boundaries give the unsplit kernel's result bit for bit."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q
        self.state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # o, m, l

    def add(self, k: torch.Tensor, v: torch.Tensor, causal: bool, last: bool) -> torch.Tensor | None:
        first = self.state is None
        if first and last:  # every key in one tile: the plain kernel
            return attention(self.q, k, v, causal)[0]
        state = self.state
        if state is None:
            n, heads, _ = self.q.shape
            f32 = {"dtype": torch.float32, "device": self.q.device}
            state = torch.empty(self.q.shape, **f32), torch.empty(n, heads, **f32), torch.empty(n, heads, **f32)
        out, _ = _ops.attention_tile(self.q, k, v, causal, *state, first, last)
        self.state = state  # only once a tile has filled it: a refused first call leaves none to carry
        return out if last else None


def parallel_width(items: int = 64) -> int:
    """How many threads the kernels' parallel loops run on now (torch.get_num_threads(), if the build
    has OpenMP; tests/test_cpu_attention.py checks it)."""
    return int(_ops.parallel_width(items))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of x [rows, hidden] in one pass (its roundings: TorchKernels.rms_norm)."""
    return _ops.rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [rows, 2 x width] in one pass (torch's roundings)."""
    return _ops.silu_and_mul(gate_up)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, cos_sin: torch.Tensor,
         is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [n, heads x d] and k [n, kv_heads x d] at `positions` from a fp32 cos|sin
    table per position: FlashInfer's `apply_rope_with_cos_sin_cache` (its signature, layout and
    fp32 arithmetic), so `Rotary.use_fused` takes either."""
    if not is_neox:
        raise ValueError("only rotate-half (neox) RoPE")
    return _ops.rope(positions, q, k, head_dim, cos_sin)


class CPUBackend:
    """Prefill tiles, a split prefill's running tiles and decode on the kernel."""

    name = "cpu"
    merge = staticmethod(merge_lse)

    def __init__(self) -> None:
        # Per thread: engines in one process may share a model (and so this backend), each on its own thread.
        self._steps = threading.local()

    def tile(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return attention(q, k, v, causal)

    def tiles(self, q: torch.Tensor) -> RunningTiles:
        return RunningTiles(q)

    def decode(self, q: torch.Tensor, layer: int, kv: KVCache, block_tables: list[list[int]],
               lengths: list[int]) -> torch.Tensor:
        """Every sequence's one query against its keys and values read in place from the paged cache: a
        gather into contiguous K and V and a prefill tile per sequence took 118 of a 206 ms decode step
        of SmolLM2 (fp32, 8 answers of 1K tokens, one EPYC core)."""
        return _ops.decode(q, kv.k[layer], kv.v[layer], *self._tables(block_tables, lengths))

    def _tables(self, block_tables: list[list[int]], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tables and lengths as tensors, made once for all its layers (the same lists each)."""
        step = getattr(self._steps, "last", None)
        if step is None or step[0] != block_tables or step[1] != lengths:
            width = max(map(len, block_tables))
            tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
            step = self._steps.last = ([list(t) for t in block_tables], list(lengths), tables,
                                       torch.tensor(lengths, dtype=torch.long))
        return step[2], step[3]

