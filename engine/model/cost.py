"""The operator cost model the split plans with (`OpCost`): predicted seconds of each operator step on
this device, measured at start-up (engine/model/calibration.py) and corrected online from executed batches.

Also the vocabulary of a plan's steps (`Step`, `SeqSpan`, the operator names), which engine/model/plan.py
cuts a prefill into.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from engine.core.config import ModelConfig

# The CPU's projections run on row counts in steps of this (engine/model/linear.py: oneDNN builds a kernel
# per row count); blocks cut on the line (a CPU, or an analytical GPU model) are cut to it, so that only a
# batch's last block is padded.
ROW_ALIGN = 16

ATTN_IN, ATTENTION, FFN = "attn_in", "attention", "ffn"
# The FFN cut by the MLP's intermediate columns as well as by rows (`OpCost.sliced_ffn_rows`): per block of
# rows, one FFN_IN step (o_proj + residual + post-norm) and one MLP step per column slice (gate/up,
# SiLU-and-mul and down of that slice, added to the residual).
FFN_IN, MLP = "ffn_in", "mlp"
# The head: the final norm and each sequence's last-token logits, cut by vocabulary columns. Reading the
# lm_head's weights dominates it (SmolLM2-135M in fp32: 113 MB, 11 ms on one AMD EPYC core, 1.5-1.8x a
# 50 ms progress report's prediction when the model left it out, which raised the whole correction 15-20 %
# after each batch and made the next 2K batch 5,128 steps where 3,614 fit its budget).
HEAD = "head"
# Whole-FFN blocks at least this tall run as well as the unsplit FFN, shorter ones starve on their
# weights: SmolLM2-135M's FFN (11.9 MB of fp32 weights per layer) over 2,048 rows, one AMD EPYC core,
# in blocks of 32 rows took +28 % over one call, 64 rows +3 to +12 %, 128 rows -11 % (its 25 MB
# intermediate then stays in cache). Below it the split cuts the MLP's columns too, where the model has
# slices (engine/model/llama.py `mlp_slices`).
SLICE_BELOW_ROWS = 128
CAUSAL_BLOCK = 256  # granularity at which attention kernels skip masked work
# Batch sizes (prompt tokens) whose prediction errors are learned apart (`OpCost.observe`): a short
# batch replaying CUDA graphs beats the calibrated line by far more than a long eager one, and one
# correction for both would size an 8K batch's steps by the speed of 32-token ones.
SIZE_CLASSES = (128, 512, 2048, 8192)  # upper bounds; longer batches are the last class


def size_class(tokens: int) -> int:
    return bisect_left(SIZE_CLASSES, tokens)


class Step(NamedTuple):
    layer: int
    op: str  # attn_in | attention | ffn | ffn_in | mlp | head
    rows: tuple[int, int]  # rows of the batch's flattened tokens this step produces
    seq: int = -1  # attention: which sequence of the batch
    keys: tuple[int, int] = (0, 0)  # attention: absolute key positions of this tile
    # attention: the tile ending at the queries' own positions, masked causally from the bottom right
    # (query j of n sees keys up to keys[1] - n + j); it completes its query block
    causal: bool = False
    cost: float = 0.0  # predicted seconds
    part: int = 0  # mlp: which of the MLP's intermediate-column slices
    cols: tuple[int, int] = (0, 0)  # head: the vocabulary columns whose logits it computes


class PrefillTerms(NamedTuple):
    """What `OpCost.prefill_s` sums for a batch, before the correction (`OpCost.prefill_terms`)."""

    rows: int
    attn_in: float
    ffn: float
    ffn_one: float  # the last layer's FFN of one sequence's last token
    attn: tuple[float, ...]  # per sequence: its attention, causal over its keys
    attn_last: tuple[float, ...]  # per sequence: its last token's attention (the last layer)
    head: float  # the head over the batch's sequences, whole


class SeqSpan(NamedTuple):
    """One sequence of a prefill batch: prompt tokens [start, start + length) of a request."""

    start: int  # tokens already in the KV cache (chunked prefill); 0 for a whole prompt
    length: int


@dataclass
class OpCost:
    """Predicted seconds of each operator step, measured on this device with the model's own ops."""

    cfg: ModelConfig
    attn_in_s_per_row: float
    ffn_s_per_row: float
    attn_s_per_pair: float  # one query against one key, all heads
    step_overhead_s: float = 20e-6
    row_step_floor_s: float = 0.0  # a row-wise step reads its weights once, however few its rows
    # Host time per batch outside its steps: the first token's sampling, finishing the requests, the next
    # decision and the next batch's set-up. Predictions of a batch add it once (`batch_s`), the engine
    # learns it from the host gaps it measures (`observe_host`), the simulator charges it: on an H200 it
    # is a quarter of a short batch (3.8 ms against 5-15 ms), on a CPU under 1 %.
    batch_host_s: float = 0.0
    scale: float = 1.0  # a multiplier on every prediction (for_batch sets it to the batch's correction)
    budget_s: float | None = None  # the step budget plans use (prefill_s counts the steps it makes)
    # Online correction (see `observe`, `factor`): how much slower than calibrated the machine runs now
    # (`machine`, shared by every batch size), and how each size class runs apart from that (`class_scale`).
    class_scale: list[float] = field(default_factory=lambda: [1.0] * (len(SIZE_CLASSES) + 1))
    class_observations: list[int] = field(default_factory=lambda: [0] * (len(SIZE_CLASSES) + 1))
    class_first: list[list[float]] = field(default_factory=lambda: [[] for _ in range(len(SIZE_CLASSES) + 1)])
    machine: float = 1.0
    # Measured seconds of one row-wise step of a given number of rows, per op: [(rows, s)] by rows
    # (CUDA calibration). A GPU runs a matmul in whole waves of output tiles over its SMs, so its time
    # is a staircase in rows, not a line: 3,104 rows can cost as many waves as 4,096. It decides where
    # the split cuts (`row_block`); predictions stay on the line, since small batches replay CUDA
    # graphs far faster than the eager blocks timed here.
    row_block_s: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # The MLP's intermediate-column slices (the model's `mlp_slices`; 1: the FFN is cut by rows only),
    # and the per-row seconds of an FFN_IN step and of one slice's MLP step (0: not measured).
    mlp_slices: int = 1
    ffn_in_s_per_row: float = 0.0
    mlp_s_per_row: float = 0.0
    # The head (HEAD) over the whole vocabulary: what one row costs (its weights read once) and each
    # further row (0: not measured, as in a profile calibrated before the head was).
    head_s: float = 0.0
    head_s_per_row: float = 0.0
    # One decode step (each running answer's next token): one answer with a short context, each answer
    # more, and each token of context more (its KV read by attention). 0: not measured (a profile
    # calibrated before decode was, or a GPU's own): the simulator's decode then takes no time.
    decode_s: float = 0.0
    decode_s_per_seq: float = 0.0
    decode_s_per_token: float = 0.0
    # Moves each time the correction or the host time learns (`observe`, `observe_host`): a prediction made at
    # the same revision (and calibration) is still the cost model's.
    revision: int = 0

    def decode_step_s(self, answers: int, context_tokens: int) -> float:
        """One decode step of `answers` answers holding `context_tokens` tokens of KV in all, at the speed
        the correction has learned the machine runs (`machine`: prefill's, shared by every size)."""
        if answers <= 0:
            return 0.0
        return self.scale * self.machine * (self.decode_s + self.decode_s_per_seq * (answers - 1)
                             + self.decode_s_per_token * context_tokens)

    def per_row_s(self, op: str) -> float:
        """Unscaled seconds per row of a row-wise op."""
        return {ATTN_IN: self.attn_in_s_per_row, FFN: self.ffn_s_per_row, FFN_IN: self.ffn_in_s_per_row,
                MLP: self.mlp_s_per_row}[op]

    def _block_per_row_s(self, op: str) -> float:
        # A sliced block's rows run through its FFN_IN step and its MLP steps: the costlier sizes it.
        return max(self.mlp_s_per_row, self.ffn_in_s_per_row) if op == MLP else self.per_row_s(op)

    def row_op_s(self, op: str, rows: int) -> float:
        return self.scale * (self.step_overhead_s + max(self.row_step_floor_s, rows * self.per_row_s(op)))

    def _slices_measured(self) -> bool:
        return self.mlp_slices > 1 and self.ffn_in_s_per_row > 0 and self.mlp_s_per_row > 0

    def sliced_ffn_rows(self, rows: int, work_s: float) -> int:
        """Rows per block where `rows` rows of the FFN are cut by the MLP's columns as well (steps get
        `work_s` each, unscaled, overhead excluded), or 0 where whole-FFN blocks do: the model has no
        slices (or they are not measured), the whole FFN's blocks would be SLICE_BELOW_ROWS tall or more,
        or the rows fit one whole step."""
        if not self._slices_measured():
            return 0
        whole = _fit(work_s, self.ffn_s_per_row, 32)
        if whole >= SLICE_BELOW_ROWS or rows <= whole:
            return 0
        return self.row_block(MLP, rows, work_s)

    def row_block(self, op: str, rows: int, work_s: float) -> int:
        """Token-block size for `rows` rows of a row-wise op whose steps get `work_s` each (unscaled,
        overhead excluded): on the line (a CPU), as many blocks as the largest multiple of 32 that
        fits needs, of even size (a multiple of ROW_ALIGN); with a measured staircase, the size up to that
        fit whose blocks (remainder included) add up to the least measured time, among those measured
        within the budget."""
        per_row = self._block_per_row_s(op)
        fit = _fit(work_s, per_row, 32)
        table = self.row_block_s.get(op)
        if not table:
            # Even blocks: a row costs less in blocks of 256-384 rows than of 128-192 (the tiny model's
            # FFN on one AVX-512 core: 5.4 against 5.7 us), so 512 rows run 2.91 ms as 256 + 256 and
            # 3.06 ms as 320 + 192; over the split layers that difference was 2-6 % of a 512-token
            # prefill. Rounded up to ROW_ALIGN rows, which oneDNN's linear runs on.
            per_block = math.ceil(rows / math.ceil(rows / fit))  # rows over the blocks `fit` needs
            return min(fit, math.ceil(per_block / ROW_ALIGN) * ROW_ALIGN)

        def measured_s(n: int) -> float:  # a block costs the next timed size's time
            i = bisect_left(table, n, key=lambda entry: entry[0])
            return self.step_overhead_s + (table[i][1] if i < len(table) else n * per_row)

        def total(size: int) -> float:
            full, rest = divmod(rows, size)
            return full * measured_s(size) + (measured_s(rest) if rest else 0.0)

        # Sizes the line fits; of those, the ones whose own measurement fits too (a block just past a
        # whole wave is measured over the budget while the line predicts it under), unless none does.
        sizes = [n for n, _ in table if n < fit] + [fit]
        return min(sizes, key=lambda size: (measured_s(size) > work_s + self.step_overhead_s, total(size), -size))

    def step_rows(self, op: str, budget_s: float | None, most: int) -> list[int]:
        """Every row count a row-wise step of `op` runs on (padded as engine/model/linear.py pads them):
        1 to ROW_ALIGN, then multiples of ROW_ALIGN up to the largest block `row_block` cuts for a
        device running twice as fast as calibrated (a correction of 0.5: calibration keeps each
        operator's best of several runs, which serving seldom beats), or up to `most` rows where that
        is less, or where there is no budget (one step per operator). MLP: the rows of the FFN_IN and MLP
        steps of an FFN cut by columns (`sliced_ffn_rows`; none where it never is)."""
        if op == MLP and (budget_s is None or not self._slices_measured()):
            return []
        top = most if budget_s is None else min(most, _fit(2 * budget_s, self._block_per_row_s(op), 32))
        return [*range(1, ROW_ALIGN + 1), *range(2 * ROW_ALIGN, top + ROW_ALIGN, ROW_ALIGN)]

    def head_op_s(self, rows: int, cols: int) -> float:
        """A head step: `rows` sequences' logits over `cols` of the vocabulary's columns."""
        whole = self.head_s + max(0, rows - 1) * self.head_s_per_row
        return self.scale * (self.step_overhead_s + whole * cols / self.cfg.vocab_size)

    def attn_s(self, queries: int, keys: int, causal: bool) -> float:
        # Causal (bottom-right): every key before the queries' own, then the diagonal square, of which
        # kernels skip the blocks above the diagonal but compute the diagonal blocks whole: half the
        # square plus one kernel block's worth (which makes a small diagonal tile cost a full one).
        if causal:
            square = min(queries, keys)
            pairs = queries * (keys - square) + square * (square + min(square, CAUSAL_BLOCK)) / 2
        else:
            pairs = queries * keys
        return self.scale * (self.step_overhead_s + pairs * self.attn_s_per_pair)

    def factor(self, tokens: int) -> float:
        """The correction for a batch of `tokens` prompt tokens: the machine's times its size class's.
        A class no batch has measured yet borrows its nearest measured class's, but only to slow down:
        running faster than calibration is what one size does (short batches replay CUDA graphs),
        running slower is what the device does (load, clocks, a calibration that kept its fastest run)."""
        k = size_class(tokens)
        if self.class_observations[k]:
            shape = self.class_scale[k]
        elif seen := [j for j, n in enumerate(self.class_observations) if n]:
            shape = max(1.0, self.class_scale[min(seen, key=lambda j: (abs(j - k), -j))])
        else:
            shape = 1.0
        return min(MAX_FACTOR, max(1 / MAX_FACTOR, self.machine * shape))

    def confirmed(self, tokens: int) -> bool:
        """Whether batches of this size class have run: its predictions are measured, not calibration alone."""
        return bool(self.class_observations[size_class(tokens)])

    def for_batch(self, tokens: int) -> OpCost:
        """This cost model as it predicts a batch of `tokens` prompt tokens: its class's correction
        folded into `scale`, on a copy that learns nothing and shares nothing with this one."""
        n = len(self.class_scale)
        return replace(self, scale=self.scale * self.factor(tokens), class_scale=[1.0] * n,
                       class_observations=[0] * n, class_first=[[] for _ in range(n)], machine=1.0)

    def observe(self, tokens: int, base_s: float, measured_s: float, whole: bool = True) -> None:
        """Refine online from steps of a batch of `tokens` prompt tokens (a running batch's progress, or
        the rest of it when it completes) that the calibrated model (no correction: `Plan.base_cost`)
        predicted at `base_s`: the device may be slower or faster than at calibration (other load,
        clocks, CUDA graphs).

        Two speeds. A class's first three measurements say how that size runs (`class_scale`, their
        median: the first steps of a new shape also pay for its first allocations, 3.2x the prediction
        for the first 50 ms of the first 8K prefill here, 1.2-1.4x after). After that, what surprises
        the prediction is mostly the machine, common to every size: half of each surprise goes to
        `machine`, so a 3x slowdown seen by short batches slows the long ones' predictions too, within
        a few batches of any size (three after a 3x step, in the simulator); the class keeps a slow average of what the
        machine does not explain. `whole`: the measurement is a whole batch (or its first part), which
        weighs at least a fifth however short; the last few milliseconds of a long batch weigh their time.
        A measurement weighs the work it measured (its predicted time), not the time a pause stretched it
        to, and its surprise counts up to MAX_SURPRISE."""
        if not (base_s > 0 and measured_s > 0):
            return
        self.revision += 1
        k = size_class(tokens)
        target = measured_s / (base_s * self.scale)
        self.class_observations[k] += 1
        first = self.class_first[k]
        if len(first) < 3:  # the class's own way, whatever the machine does
            first.append(target / self.machine)
            self.class_scale[k] = _clamp(statistics.median(first))
            return
        expected_s = base_s * self.scale * self.machine * self.class_scale[k]
        surprise = min(MAX_SURPRISE, max(1 / MAX_SURPRISE, measured_s / expected_s))
        floor = 0.2 if whole else 0.0
        weight = _weight(expected_s, MACHINE_HALF_LIFE_S, floor)  # the work it measured, not its pauses
        self.machine = _clamp(self.machine * (1 + weight * (surprise - 1)))
        w = _weight(measured_s, CLASS_HALF_LIFE_S, 0.0)
        self.class_scale[k] = _clamp((1 - w) * self.class_scale[k] + w * target / self.machine)

    def step_s(self, step: Step) -> float:
        """What this cost model says one planned step takes."""
        if step.op == ATTENTION:
            return self.attn_s(step.rows[1] - step.rows[0], step.keys[1] - step.keys[0], step.causal)
        if step.op == HEAD:
            return self.head_op_s(step.rows[1] - step.rows[0], step.cols[1] - step.cols[0])
        return self.row_op_s(step.op, step.rows[1] - step.rows[0])

    def prefill_s(self, spans: list[SeqSpan], terms: PrefillTerms | None = None) -> float:
        """Predicted time of a whole prefill (every layer) of these spans, as the engine plans it
        (the last layer computes attention and MLP for each sequence's last token only; an operator
        longer than `budget_s` is split into steps, each with its overhead), with its size class's
        correction. Each operator is counted once with the steps its own split adds: counting a
        sequence's attention as two (its prefix and its square, the first empty without a prefix) and
        the split's steps over the whole prefill, as this did, predicted a 16-token prefill 16 % over
        its plan and 128 tokens 5 % (a 2-core EPYC's profile, 88 us a step). `terms`: the spans'
        `prefill_terms` from this cost model, computed before (what a caller remembers per request)."""
        t = terms or self.prefill_terms(spans)
        factor = self.factor(t.rows)  # applied to the sum: one for_batch copy per call would cost more
        step_s = self.scale * factor * self.step_overhead_s
        work = max(self.budget_s - step_s, self.budget_s / 2) if self.budget_s else math.inf

        def op(seconds: float) -> float:  # with the overheads of the steps its split adds
            seconds *= factor
            return seconds + max(0.0, math.ceil(seconds / work) - 1) * step_s

        attn_in = op(t.attn_in)
        per_layer = attn_in + (self._sliced_ffn_s(t.rows, factor) or op(t.ffn)) + sum(op(a) for a in t.attn)
        last = attn_in + sum(op(a) for a in t.attn_last) + op(t.ffn_one) * len(t.attn)
        return per_layer * (self.cfg.num_hidden_layers - 1) + last + op(t.head)

    def prefill_terms(self, spans: list[SeqSpan]) -> PrefillTerms:
        """The operators' calibrated seconds a prediction of these spans sums (`prefill_s`), before the
        correction: they change only with the spans and the calibration."""
        rows = sum(s.length for s in spans)
        return PrefillTerms(rows, self.row_op_s(ATTN_IN, rows), self.row_op_s(FFN, rows), self.row_op_s(FFN, 1),
                            tuple(self.attn_s(s.length, s.start + s.length, True) for s in spans),
                            tuple(self.attn_s(1, s.start + s.length, True) for s in spans),
                            self.head_op_s(len(spans), self.cfg.vocab_size))

    def terms_key(self) -> tuple[float | None, ...]:
        """What `prefill_terms` depends on besides the spans (a caller remembering terms compares it): the
        calibrated line and the scale, not the correction."""
        return (self.scale, self.budget_s, self.step_overhead_s, self.attn_in_s_per_row, self.ffn_s_per_row,
                self.attn_s_per_pair, self.row_step_floor_s, self.head_s, self.head_s_per_row)

    def batch_s(self, spans: list[SeqSpan]) -> float:
        """Predicted time from a batch's start to its first tokens: its prefill (`prefill_s`) and the host's
        time per batch, which a batch pays once whatever its size (what merging requests saves)."""
        return self.prefill_s(spans) + self.batch_host_s

    def observe_host(self, seconds: float) -> None:
        """Learn the host's time per batch from one measured host gap (the device idle between a batch's
        work arriving, or the previous step ending, and its first step): an exponential average whose
        sample counts up to MAX_SURPRISE times the current value (plus a millisecond), so that one pause
        (the collector, a process starting beside it) does not make every batch look expensive."""
        if seconds < 0:
            return
        self.revision += 1
        sample = min(seconds, MAX_SURPRISE * self.batch_host_s + 1e-3)
        self.batch_host_s += HOST_WEIGHT * (sample - self.batch_host_s)

    def _sliced_ffn_s(self, rows: int, factor: float) -> float:
        """`prefill_s`'s FFN of `rows` rows where the plan cuts its MLP by columns (0.0 where it does not):
        per block an FFN_IN step and `mlp_slices` MLP steps, each with its overhead."""
        if not self.budget_s or self.mlp_slices < 2:
            return 0.0
        scale = self.scale * factor  # the batch's plan sizes its blocks as plan_prefill does
        block = self.sliced_ffn_rows(rows, max(self.budget_s / scale - self.step_overhead_s, self.budget_s / scale / 2))
        if not block:
            return 0.0
        added = (math.ceil(rows / block) - 1) * (self.mlp_slices + 1)  # steps past one per op
        return factor * (self.row_op_s(FFN_IN, rows) + self.mlp_slices * self.row_op_s(MLP, rows)
                         + added * self.scale * self.step_overhead_s)


MAX_FACTOR = 20.0  # a correction stays within 1/20 .. 20x of calibration
# One measurement moves the machine's factor by at most this ratio's worth of its weight (which is its
# predicted time's, see `observe`). A short batch that a pause (the collector, the OS, a process starting
# beside it) stretches from 13 ms to 200 ms reads 15x: weighed by its 200 ms, as before, it would multiply
# every prediction by 14 at once (enough for a long `batch` request to predict past its 6 s target and
# be refused); now by 1.6. A real 3x slowdown is still followed within three batches (tests/test_predictor.py).
MAX_SURPRISE = 4.0
# The machine's factor is an exponential average over the predicted time of what was measured, with this half-life
# (half of a 50 ms progress report's surprise), and takes at least a fifth of any batch's surprise:
# after a 3x slowdown its predictions are within 10 % in 3 batches (the simulator's slowdown levels).
MACHINE_HALF_LIFE_S = 0.05
# A size class's own way, after a running mean of its first three measurements: an exponential
# average over its measured time with this half-life, slow, so that a slowdown goes to the machine.
CLASS_HALF_LIFE_S = 2.0
# The host time per batch is an exponential average of the measured gaps with this weight: about the
# last ten batches.
HOST_WEIGHT = 0.1


def _clamp(x: float) -> float:
    return min(MAX_FACTOR, max(1 / MAX_FACTOR, x))


def _weight(measured_s: float, half_life_s: float, floor: float) -> float:
    """The weight of a measurement of `measured_s` in an average over time with this half-life."""
    return max(floor, 1 - 0.5 ** (measured_s / half_life_s))


def _fit(budget_s: float, per_unit_s: float, quantum: int) -> int:
    return max(quantum, int(budget_s / per_unit_s) // quantum * quantum)


