"""engines/runtime/memory.py `keep_freed_host_memory`: a CPU engine's freed host memory is reused,
not mapped and faulted in again. Checked by the kernel's own count of page faults (getrusage) for
tensors of growing sizes, as a process meets larger activations step after step, in fresh
interpreters (the setting is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GROWING = """
import resource, sys
import torch
from engines.runtime.memory import keep_freed_host_memory
if sys.argv[1] == "keep":
    print("set", keep_freed_host_memory())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 31):  # 1 to 30 MiB, each written and freed
    t = torch.empty(mib << 18)
    t.fill_(1.0)
    del t
print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run(mode: str, env: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "LD_PRELOAD")} | (env or {})
    out = subprocess.run([sys.executable, "-c", GROWING, mode], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_growing_tensors_fault_in_each_page_once():
    default, kept = run("default"), run("keep")
    assert kept["set"] == "True"
    pages = sum(range(1, 31)) * (1 << 20) // 4096  # 465 MiB written: every page faulted in anew
    # glibc's defaults map each new largest block and unmap it on free: every page is faulted in
    # (119,115 here). Kept, the blocks come from the heap, which grows with the largest block and
    # keeps what it grew: 16,156-17,434 here (30 MiB is 7,680 pages; torch's own small blocks and the
    # heap's growth steps make the rest)
    assert int(default["faults"]) > 0.9 * pages
    assert int(kept["faults"]) < 0.2 * pages


def test_a_users_allocator_settings_are_left_alone():
    assert run("keep", {"MALLOC_ARENA_MAX": "2"})["set"] == "False"


def test_a_measured_cpu_engine_keeps_freed_memory_and_a_simulated_one_does_not_touch_it():
    script = """
import sys
from engines.registry import create_engine
from engines.runtime import memory
options = {"model": "engines/demo_model", **({"device": "cpu"} if sys.argv[1] == "cpu" else {"simulate": "cpu"})}
engine = create_engine("moe", options)
engine.start()
engine.stop()
print(memory._HOST_MALLOC_SET)
"""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "LD_PRELOAD")}
    got = {}
    for mode in ("cpu", "simulated"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got[mode] = out.stdout.split()[-1]
    assert got == {"cpu": "True", "simulated": "None"}
