"""The run: the `pwbench` CLI and, as they land, the step loop, metrics, telemetry and result files.
It talks to engines only through engines.base and engines.registry."""
