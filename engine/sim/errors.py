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
    many times as long for everything, the model as it was."""

    noise: float = 0.0
    bias: float = 1.0
    slowdown: float = 1.0
    slowdown_at: float = 0.5
    label: str = "none"
    # The noise's draws have mean one (what a prediction of the mean expects), or, False, median one (a
    # speed per size taken as the median of measured batches, as `flowprefill plan`'s pilot takes it)
    noise_mean_one: bool = True

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
        return TrueSpeed(self, self.step_at(start_s, start_s + span_s), random.Random(seed))

    def step_at(self, first_s: float, last_s: float) -> float:
        """When the slowdown step comes in a run whose arrivals go from `first_s` to `last_s`."""
        return first_s + self.slowdown_at * (last_s - first_s)


class TrueSpeed:
    """True seconds per predicted (calibrated) second, for a batch that starts at a given time."""

    def __init__(self, error: PredictionError, slowdown_from_s: float, rng: random.Random) -> None:
        self.error, self.slowdown_from_s, self.rng = error, slowdown_from_s, rng

    def batch_factor(self) -> float:
        """A new batch's own draw (noise only): the rest of its factor depends on the time it runs."""
        sigma = self.error.noise
        if not sigma:
            return 1.0
        return self.rng.lognormvariate(-sigma * sigma / 2 if self.error.noise_mean_one else 0.0, sigma)

    def at(self, t: float) -> float:
        """The machine's factor at virtual time t (the slowdown step)."""
        return self.error.slowdown if t >= self.slowdown_from_s else 1.0

    def next_change_after(self, t: float) -> float:
        """When the machine's factor next changes after t (inf: never)."""
        return self.slowdown_from_s if self.error.slowdown != 1.0 and t < self.slowdown_from_s else math.inf
