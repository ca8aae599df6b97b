"""Everything that turns a trace or a generator into timed requests; no torch, no engines.

registry (names, WorkloadSpec, ModelTarget, build_workload) -> shapes (request skeletons) ->
arrivals and assemble (times, bounds, clipping) -> synth (token ids, held or made on reading
by prompts.PromptIds). traces/ reads files.
"""
