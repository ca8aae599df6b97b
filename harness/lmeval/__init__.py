"""lm-eval over pwbench engines: the `pwbench` LM for lm-eval and the demo tasks as offline lm-eval tasks."""
