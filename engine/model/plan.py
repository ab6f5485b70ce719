"""The prefill of a batch as a flat list of operator steps, each predicted to fit a time budget.

This is where the *sub-operator split* lives: row-wise operators are cut into token blocks,
attention into (query block x key tile) pieces and the head into vocabulary columns, so that no
step outlasts `budget_s` and a preemption request never waits longer than one step, whatever the
prompt length. Where the FFN's blocks would be too short to run well, its MLP is cut by intermediate
columns as well (FFN_IN and MLP steps, `OpCost.sliced_ffn_rows`), and the blocks grow by as much.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

from engine.model.cost import ATTENTION, ATTN_IN, FFN, FFN_IN, HEAD, MLP, OpCost, SeqSpan, Step, _fit

# Keys per attention tile come in multiples of this: the CPU kernel computes keys 128 at a time, so a tile of
# 192 took as long as one of 256 (1.92 against 1.98 ms for SmolLM2's 256 queries, one EPYC core).
KEY_QUANTUM = 128


def _blocks(total: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, total)) for a in range(0, total, size)]


class Plan(Sequence[Step]):
    """A batch's steps: one per-layer sequence repeated for every layer but the last, which may
    have its own (see `plan_prefill`); materialised lazily, since a long prompt on a deep model
    has hundreds of thousands of steps."""

    def __init__(self, layer_steps: list[Step], num_layers: int, last_layer: list[Step] | None = None) -> None:
        self.layer_steps, self.num_layers = layer_steps, num_layers
        self.last_layer = layer_steps if last_layer is None else last_layer
        self._per_layer = len(layer_steps)
        self._body = self._per_layer * (num_layers - 1)  # steps before the last layer
        self._prefix = _prefix_sums(layer_steps)
        self._last_prefix = _prefix_sums(self.last_layer)
        self.total_cost = self._prefix[-1] * (num_layers - 1) + self._last_prefix[-1]
        self.scale = 1.0  # the cost model's online correction when this plan was made

    @property
    def base_cost(self) -> float:
        """Predicted time in the calibrated model's own units (before the online correction)."""
        return self.total_cost / self.scale

    def __len__(self) -> int:
        return self._body + len(self.last_layer)

    def _locate(self, i: int) -> tuple[int, list[Step], int]:
        if i < self._body:
            layer, j = divmod(i, self._per_layer)
            return layer, self.layer_steps, j
        return self.num_layers - 1, self.last_layer, i - self._body

    def cost(self, i: int) -> float:
        _, steps, j = self._locate(i)
        return steps[j].cost

    def cost_before(self, i: int) -> float:
        """Predicted time of steps [0, i)."""
        if i <= self._body:
            layers, j = divmod(i, self._per_layer)
            return layers * self._prefix[-1] + self._prefix[j]
        return (self.num_layers - 1) * self._prefix[-1] + self._last_prefix[i - self._body]

    def first_step_ending_after(self, t: float) -> int:
        """Index of the step during which cumulative predicted time passes t."""
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cost_before(mid + 1) <= t:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @overload
    def __getitem__(self, i: int) -> Step: ...
    @overload
    def __getitem__(self, i: slice) -> list[Step]: ...
    def __getitem__(self, i: int | slice) -> Step | list[Step]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        layer, steps, j = self._locate(i)
        return Step._make((layer, *steps[j][1:]))

    def __iter__(self) -> Iterator[Step]:
        # `_make`, not `_replace`: half the time, in a loop each of whose steps runs on cold caches.
        for layer in range(self.num_layers):
            for s in self.layer_steps if layer < self.num_layers - 1 else self.last_layer:
                yield Step._make((layer, *s[1:]))


def _prefix_sums(steps: list[Step]) -> list[float]:
    out = [0.0]
    for s in steps:
        out.append(out[-1] + s.cost)
    return out


def _head_steps(cost: OpCost, sequences: int, budget_s: float | None) -> list[Step]:
    """The head (each sequence's last-token logits) in vocabulary column blocks, each within the budget;
    one step without one. Blocks of whole multiples of 64 columns: a memory-bound matrix-vector product
    loses nothing cut by columns, as each block reads only its own weights."""
    vocab = cost.cfg.vocab_size
    whole = cost.head_op_s(sequences, vocab) - cost.scale * cost.step_overhead_s
    parts = 1
    if budget_s is not None and whole > 0:
        work_s = max(budget_s - cost.scale * cost.step_overhead_s, budget_s / 2)
        parts = min(math.ceil(whole / work_s), max(1, vocab // 64))
    size = math.ceil(vocab / parts / 64) * 64
    return [Step(0, HEAD, (0, sequences), cols=(a, b), cost=cost.head_op_s(sequences, b - a))
            for a, b in _blocks(vocab, size)]


def _step_sizes(cost: OpCost, spans: list[SeqSpan], rows: int, budget_s: float | None
                ) -> tuple[int, int, int, int, int]:
    """The blocks a budget cuts a batch's operators into: rows per ATTN_IN step and per FFN step, rows per
    block of an FFN cut by the MLP's columns too (0: whole-FFN blocks), queries per attention block and
    keys per tile. budget_s=None: one step per operator."""
    if budget_s is None:
        big = 1 << 62
        return big, big, 0, big, big
    # Sizes in the cost model's unscaled units; `scale` says how much slower the device runs batches of
    # this size now.
    work_s = max(budget_s / cost.scale - cost.step_overhead_s, budget_s / cost.scale / 2)
    # Query blocks as large as the budget allows (fewer, larger tiles parallelise better and are fewer
    # calls), down to 32 when even a small diagonal tile would outlast it.
    longest = max((s.length for s in spans), default=1)
    q_block = 256
    while q_block < longest and cost.attn_s(2 * q_block, 2 * q_block, True) <= budget_s:
        q_block *= 2
    while q_block > 32 and cost.attn_s(q_block, q_block, True) > budget_s:
        q_block //= 2
    key_tile = max(q_block, _fit(work_s, q_block * cost.attn_s_per_pair, KEY_QUANTUM))
    return (cost.row_block(ATTN_IN, rows, work_s), cost.row_block(FFN, rows, work_s),
            cost.sliced_ffn_rows(rows, work_s), q_block, key_tile)


def plan_prefill(cost: OpCost, spans: list[SeqSpan], budget_s: float | None, last_token_only: bool = False) -> Plan:
    """All steps of a batch's prefill, layer by layer. budget_s=None: one step per operator.
    last_token_only: only each sequence's last-token logits will be read (what serving needs)."""
    rows = sum(s.length for s in spans)
    cost = cost.for_batch(rows)
    starts = [0]
    for s in spans:
        starts.append(starts[-1] + s.length)
    in_rows, ffn_rows, sliced, q_block, key_tile = _step_sizes(cost, spans, rows, budget_s)

    def layer(query_rows: list[tuple[int, int]] | None) -> list[Step]:
        """One layer's steps; query_rows: per sequence, the rows whose outputs are needed (all if None)."""
        steps = [Step(0, ATTN_IN, (a, b), cost=cost.row_op_s(ATTN_IN, b - a)) for a, b in _blocks(rows, in_rows)]
        for i, span in enumerate(spans):
            row0 = starts[i]
            q_ranges = _blocks(span.length, q_block) if query_rows is None else [query_rows[i]]
            for qs, qe in q_ranges:
                block, end = (row0 + qs, row0 + qe), span.start + qe
                whole = cost.attn_s(qe - qs, end, True)
                if budget_s is None or whole <= budget_s:  # every key in one step: one kernel
                    steps.append(Step(0, ATTENTION, block, i, (0, end), True, whole))
                    continue
                for ka, kb in _blocks(span.start + qs, key_tile):
                    steps.append(Step(0, ATTENTION, block, i, (ka, kb), cost=cost.attn_s(qe - qs, kb - ka, False)))
                steps.append(Step(0, ATTENTION, block, i, (span.start + qs, end), True,
                                  cost.attn_s(qe - qs, qe - qs, True)))
        if query_rows is None and sliced:
            for a, b in _blocks(rows, sliced):
                steps.append(Step(0, FFN_IN, (a, b), cost=cost.row_op_s(FFN_IN, b - a)))
                steps += [Step(0, MLP, (a, b), cost=cost.row_op_s(MLP, b - a), part=j) for j in range(cost.mlp_slices)]
            return steps
        ffn_rows_ranges = (_blocks(rows, ffn_rows) if query_rows is None
                           else [(starts[i] + qs, starts[i] + qe) for i, (qs, qe) in enumerate(query_rows)])
        steps += [Step(0, FFN, (a, b), cost=cost.row_op_s(FFN, b - a)) for a, b in ffn_rows_ranges]
        return steps

    body = layer(None)
    # The last layer's attention and MLP outputs are read only at each sequence's last token (its
    # logits); its K/V are still written for every token.
    last = layer([(s.length - 1, s.length) for s in spans]) if last_token_only else list(body)
    plan = Plan(body, cost.cfg.num_hidden_layers, last + _head_steps(cost, len(spans), budget_s))
    plan.scale = cost.scale
    return plan
