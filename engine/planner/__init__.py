"""The capacity planner, `flowprefill plan`: how many prefill instances a workload needs to meet an SLO
attainment target, per policy. Its entry is `engine.planner.command` (`main`, `build_parser`).

- `command.py`: the command line, the workload planned, each policy's smallest fleet, plan.json, in steps
  (`parse`, `set_up`, `measure_speeds`, `make_plan`, `write_outputs`) that its validation composes too;
- `fleet.py`: the workload simulated on N instances behind the gateway's routing (`Planner`, `plan_policy`);
- `routing.py`: the gateway's own `WorkerPool` as the simulated fleet's router, prefix affinity's keys;
- `speed.py`: the speed the plan runs at: an engine pass, a pilot through a real `serve`, `--speed-from`;
- `measured.py`: what a real run's batch logs say beyond speed (`Planned`: host time, time outside the
  workers, serving CPU, how batches stray);
- `serve_runs.py`: a real `flowprefill serve` fleet run on this machine (a pilot's, its validation's);
- `report.py`: the tables and plots of plan.json.

Its validation against real `serve` runs, `flowprefill bench planner`, is a benchmark of it, in
engine/bench/planner_validation/: it builds on the planner, and the planner imports nothing of the benchmarks.
"""
