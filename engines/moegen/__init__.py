"""Module-based batching (MoE-Gen): the layer-major executor, streamed experts, and the cost model (engine `moegen`)."""
