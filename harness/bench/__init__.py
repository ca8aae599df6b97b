"""Benchmarks that print their numbers (`python -m harness.bench.<name>`); never run as tests."""
