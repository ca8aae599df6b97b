"""pwbench's MoE runtime in torch: config, checkpoint loading, weight and expert stores, paged KV
cache, attention, expert compute, scheduler, sampling and the host<->device transfer ledger."""
