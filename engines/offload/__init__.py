"""Expert offloading (engine `offload`): experts in the host tier, a device cache of slots per layer."""
