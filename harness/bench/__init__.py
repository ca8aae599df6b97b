"""Benchmarks that print their numbers (`python -m harness.bench.<name>`); never run as tests."""

from typing import Any


def fresh_process(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh interpreter (spawned: nothing inherited but the environment and the CPU
    affinity): what a run leaves in a process (engines not yet collected, allocator and torch caches)
    slows the next run there (the bundled model's repeats in one process took 0.27 -> 0.36 s, 0.57 ->
    0.95 s of step CPU time one after another), and one process's timings differ from the next's."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
