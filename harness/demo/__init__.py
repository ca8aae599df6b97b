"""The bundled demo model's trainer, evaluator and probes (the model itself: engines/demo_model)."""
