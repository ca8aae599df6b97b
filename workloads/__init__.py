"""Everything that turns a trace or a generator into timed requests (see the workloads issue)."""
