"""The rule that keeps a GPU fed, checked on the CPU: no prefill step reads device data on the host.

On a GPU such a read (`int(t)`, `.item()`, `.tolist()`, boolean-mask indexing, `nonzero`) waits for
every kernel queued so far, so the host stops running ahead and the GPU idles between steps; one such
read per layer cost the H200 run a third of its throughput. tests/test_flashinfer.py checks the rule
with torch's CUDA sync debug mode; this checks the same code paths on any machine by intercepting the
calls that would sync, at the Python level (torch function mode) and inside operators (dispatch mode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers import RerunCapture
from test_preemption import BUDGET, COST, fresh_kv, make_weights, prompt
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.attention.sdpa import SDPABackend
from engine.core.config import ModelConfig
from engine.model.cost import SeqSpan
from engine.model.graphs import StepGraphs
from engine.model.llama import LlamaModel
from engine.model.plan import plan_prefill

# Tensor methods that copy device data to the host (a CUDA synchronisation).
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu}
# Operators whose output shape depends on the data, or that return a host value.
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero",
               "aten::equal", "aten::unique_consecutive", "aten::_unique2", "aten::unique_dim"}


class HostReadError(AssertionError):
    pass


class _NoHostReadsFn(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in HOST_READS:
            raise HostReadError(f"{getattr(func, '__name__', func)} reads device data on the host")
        return func(*args, **(kwargs or {}))


class _NoSyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name
        bool_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
        if name in SYNCING_OPS or bool_index or (name == "aten::repeat_interleave" and "output_size" not in kwargs):
            raise HostReadError(f"{name} needs the device's data on the host")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads() -> Iterator[None]:
    with _NoHostReadsFn(), _NoSyncingOps():
        yield


# Llama-shaped (no q/k/v bias) with a scaled RoPE, so the rotary path a Llama 3 checkpoint takes runs.
LLAMA3 = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                     eos_token_id=[0], attention_bias=False, rope_scaling={
                         "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 1024}, name="tiny-llama3")


def test_the_guard_catches_what_would_sync() -> None:
    """A guard that cannot fail checks nothing: each kind of read it must catch."""
    t = torch.arange(6.0)
    for read in (lambda: int(t.max()), lambda: t.sum().item(), lambda: t.tolist(), lambda: t[t > 2],
                 lambda: bool(t.any()), lambda: torch.nonzero(t), lambda: t[:t.long()[2]],
                 lambda: t.repeat_interleave(t.long())):
        with pytest.raises(HostReadError), no_host_reads():
            read()
    with no_host_reads():  # device-side work is fine
        (t * 2).sum().exp()[None].expand(3)


@pytest.mark.parametrize("cfg", [LLAMA3, None], ids=["llama3-rope", "qwen2-bias"])
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["unsplit", "split"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_no_prefill_step_reads_device_data(cfg: ModelConfig | None, budget: float | None, graphs: bool) -> None:
    """Every step after the batch set-up (which runs up to the first yield) and before the logits;
    with `graphs`, the CUDA-graph path (engine/model/graphs.py; loading the bucket is set-up)."""
    from test_preemption import CFG
    cfg = cfg or CFG
    model = LlamaModel(cfg, make_weights(cfg), SDPABackend())
    capture = RerunCapture()
    if graphs:
        model.graphs = StepGraphs(model, 512, capture)
    kv = fresh_kv()
    # a cached prefix (a chunked prompt's second chunk) and a fresh prompt, ragged
    prompts = [prompt(300, 1), prompt(70, 2)]
    tables = [kv.allocate(len(p)) for p in prompts]
    for _ in model.prefill([prompts[0][:100]], [SeqSpan(0, 100)], tables[:1], kv,
                           plan_prefill(COST, [SeqSpan(0, 100)], None)):
        pass
    capture.replays = 0  # the prefix above replayed too: count this batch's
    spans = [SeqSpan(100, 200), SeqSpan(0, 70)]
    steps = plan_prefill(COST, spans, budget, last_token_only=True)
    run = model.prefill([prompts[0][100:], prompts[1]], spans, tables, kv, steps)
    next(run)
    with no_host_reads():
        for _ in range(len(steps) - 1):
            next(run)
    with pytest.raises(StopIteration) as done:
        next(run)
    assert torch.isfinite(done.value.value).all()
    assert (capture.replays > 0) == (graphs and budget is None)  # the split's partial steps run eagerly
