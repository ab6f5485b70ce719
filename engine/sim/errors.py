"""Prediction error injected into the simulator: the machine's true costs deviate from the cost model
the scheduler predicts with, as a real machine's do (a loaded CPU, clocks, a calibration that kept its
fastest run). The scheduler's online correction sees only the true costs, as the engine's does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("none", "noise", "bias", "slowdown")
# What `bench goodput --engine sim --errors` sweeps by default: the levels.
DEFAULT_LEVELS = "none,noise:0.2,noise:0.5,noise:1,slowdown:2,slowdown:3,slowdown:5,bias:0.2,bias:5"


@dataclass(frozen=True)
class PredictionError:
    """How true costs deviate from predictions. `noise`: each batch's true time is its prediction times
    a lognormal draw of this sigma, with mean one (what no correction can learn: a batch is as likely
    2x slower as the next one 2x faster); `bias`: the scheduler's model starts out predicting `bias` x
    the true time (0.2: five times optimistic, 5: five times pessimistic), the machine unchanged;
    `slowdown`: from `slowdown_at` (a fraction of the run's arrival span) on, the machine takes this
    many times as long for everything, the model as it was; `drift`: besides each batch's own draw, the
    machine's speed wanders slowly (a shared host's neighbours come and go), a lognormal factor of this
    sigma that forgets itself over `drift_s` seconds (an Ornstein-Uhlenbeck process in its log)."""

    noise: float = 0.0
    bias: float = 1.0
    slowdown: float = 1.0
    slowdown_at: float = 0.5
    label: str = "none"
    # The noise's draws have mean one (what a prediction of the mean expects), or, False, median one (a
    # speed per size taken as the median of measured batches, as `flowprefill plan`'s pilot takes it)
    noise_mean_one: bool = True
    drift: float = 0.0
    drift_s: float = 2.0

    def __post_init__(self) -> None:
        if self.drift and not self.drift_s > 0:
            raise ValueError(f"a drift of sigma {self.drift} needs a time to forget itself over (drift_s > 0)")

    @classmethod
    def parse(cls, spec: str) -> PredictionError:
        """none | noise:SIGMA | bias:FACTOR | slowdown:FACTOR[@FRACTION]"""
        kind, _, arg = spec.strip().partition(":")
        if kind not in KINDS or (kind == "none") != (arg == ""):
            raise ValueError(f"prediction error {spec!r}: expected one of none, noise:SIGMA, bias:FACTOR, "
                             "slowdown:FACTOR[@FRACTION of the run]")
        if kind == "none":
            return cls()
        value, _, at = arg.partition("@")
        try:
            x, when = float(value), float(at) if at else 0.5
        except ValueError:
            raise ValueError(f"prediction error {spec!r}: {arg!r} is not a number") from None
        if not math.isfinite(x) or x < 0 or (kind != "noise" and x == 0) or not 0 <= when <= 1:
            raise ValueError(f"prediction error {spec!r}: the factor must be > 0 (a sigma >= 0), "
                             "the fraction in [0, 1]")
        if kind == "noise":
            return cls(noise=x, label=spec)
        if kind == "bias":
            return cls(bias=x, label=spec)
        return cls(slowdown=x, slowdown_at=when, label=spec)

    def machine(self, span_s: float, seed: int = 0, start_s: float = 0.0) -> TrueSpeed:
        """The machine of one run whose arrivals span `span_s` seconds from `start_s`."""
        drift = Drift(self.drift, self.drift_s, start_s, random.Random(seed * DRIFT_SEED + 1)) if self.drift else None
        return TrueSpeed(self, self.step_at(start_s, start_s + span_s), random.Random(seed), drift)

    def step_at(self, first_s: float, last_s: float) -> float:
        """When the slowdown step comes in a run whose arrivals go from `first_s` to `last_s`."""
        return first_s + self.slowdown_at * (last_s - first_s)


DRIFT_SEED = 104729  # the drift's draws are a stream of their own: adding it moves no batch's own draw
# The drift holds still for this share of its correlation time (a step of the simulation begun in a stretch
# runs at that stretch's speed): fine enough that the process keeps its correlation, coarse enough that a
# 36 s run has a few hundred stretches (2 s: 0.2 s stretches).
DRIFT_STEP_SHARE = 0.1


class Drift:
    """The machine's slow wander: a lognormal factor, median one, of stationary sigma `sigma`, held for
    stretches of `DRIFT_STEP_SHARE * tau_s` seconds from `start_s`, each stretch correlated with the one
    before by exp(-stretch / tau_s) (an Ornstein-Uhlenbeck process in the log, sampled exactly)."""

    def __init__(self, sigma: float, tau_s: float, start_s: float, rng: random.Random) -> None:
        self.start_s, self.rng = start_s, rng
        self.stretch_s = DRIFT_STEP_SHARE * tau_s
        self.keep = math.exp(-DRIFT_STEP_SHARE)
        self.fresh = sigma * math.sqrt(1 - self.keep * self.keep)  # a stretch's own draw, keeping sigma
        self.logs = [rng.gauss(0.0, sigma)]

    def _index(self, t: float) -> int:
        return max(0, int((t - self.start_s) // self.stretch_s))

    def at(self, t: float) -> float:
        k = self._index(t)
        while len(self.logs) <= k:
            self.logs.append(self.keep * self.logs[-1] + self.rng.gauss(0.0, self.fresh))
        return math.exp(self.logs[k])

    def next_change_after(self, t: float) -> float:
        return self.start_s + (self._index(t) + 1) * self.stretch_s


class TrueSpeed:
    """True seconds per predicted (calibrated) second, for a batch that starts at a given time."""

    def __init__(self, error: PredictionError, slowdown_from_s: float, rng: random.Random,
                 drift: Drift | None = None) -> None:
        self.error, self.slowdown_from_s, self.rng, self.drift = error, slowdown_from_s, rng, drift

    def batch_factor(self) -> float:
        """A new batch's own draw (noise only): the rest of its factor depends on the time it runs."""
        sigma = self.error.noise
        if not sigma:
            return 1.0
        return self.rng.lognormvariate(-sigma * sigma / 2 if self.error.noise_mean_one else 0.0, sigma)

    def at(self, t: float) -> float:
        """The machine's factor at virtual time t (the slowdown step, the drift)."""
        step = self.error.slowdown if t >= self.slowdown_from_s else 1.0
        return step * self.drift.at(t) if self.drift else step

    def next_change_after(self, t: float) -> float:
        """When the machine's factor next changes after t (inf: never)."""
        step = self.slowdown_from_s if self.error.slowdown != 1.0 and t < self.slowdown_from_s else math.inf
        return min(step, self.drift.next_change_after(t)) if self.drift else step
