"""pwbench's MoE runtime in torch: config, checkpoint loading, weight records and expert backends,
public model blocks, paged KV cache and its memory sizing, attention, scheduler, step batches
and the executor, sampling, and the host<->device transfer ledger. Imports no quantization."""
