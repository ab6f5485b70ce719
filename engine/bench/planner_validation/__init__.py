"""The capacity planner (engine/planner/) measured against real `flowprefill serve` runs on this machine:
`flowprefill plan --against-serve N,N` (`against_serve.py`), each round's run against the pilot just
before it (`paired.py`), several runs as one (`median.py`)."""
