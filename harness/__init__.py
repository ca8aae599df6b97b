"""The run: the `pwbench` CLI, the step loop, the offline driver, metrics, telemetry, result files,
the demo model's trainer and evaluator, and benchmarks. It talks to engines through
engines.base and engines.registry (capability flags, never engine names)."""
