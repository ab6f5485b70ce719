"""The capacity planner (engine/planner/) measured against real `flowprefill serve` runs on this machine:
`flowprefill bench planner --against-serve N,N` (`command.py`, which plans with the planner's own steps), the
real fleets beside their simulations (`against_serve.py`), each round's run against the pilot just before it
(`paired.py`), several runs as one (`median.py`), the comparison's tables, verdict and plot (`report.py`)."""
