"""A discrete-event simulator that drives the real scheduler and policies on a virtual clock."""

from engine.sim.oracle import ExactCosts
from engine.sim.simulator import SimConfig, simulate

__all__ = ["ExactCosts", "SimConfig", "simulate"]
