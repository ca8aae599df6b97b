"""`pwbench --help` and `pwbench ls engines` import neither torch nor triton; packages keep their arrows."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers", "safetensors", "numpy")


def imported_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split("\n")[-2].split())


@pytest.mark.parametrize("argv", [["--help"], ["ls", "engines"], ["ls", "--help"], ["generate", "--help"],
                                  ["serve", "--help"], ["import", "vllm", "--help"]])
def test_cli_paths_import_nothing_heavy(argv):
    code = f"from harness.cli import app\ntry:\n    app({argv!r})\nexcept SystemExit:\n    pass"
    mods = imported_after(code)
    assert not [m for m in HEAVY if m in mods]


def test_ls_engines_lists_every_engine():
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "ls", "engines"], capture_output=True, text=True)
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == ["dummy", "full", "hf", "moe", "moegen", "offload", "openai", "pagedweight", "static-awq",
                     "static-gptq", "static-rtn"]


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("engines.registry", HEAVY + ("harness", "workloads", "reports")),
        ("engines.base", HEAVY),
        ("engines.dummy", HEAVY + ("harness", "workloads", "reports")),
        ("engines.remote", HEAVY + ("harness", "workloads", "reports", "aiohttp")),  # aiohttp only at start()
        ("engines.moe", ("harness", "workloads", "reports", "triton")),
        ("engines.hf", ("harness", "workloads", "reports", "transformers")),  # transformers only at start()
        ("engines.moegen.engine", ("harness", "workloads", "reports", "triton")),
        ("engines.moegen.cost", HEAVY + ("harness", "workloads", "reports")),
        ("reports", HEAVY + ("engines", "harness", "workloads")),
        ("reports.summary_table", HEAVY + ("engines", "workloads")),
        # the report and the gate read result files: pandas/pyarrow (so numpy), never torch or an engine
        ("reports.html", ("torch", "triton", "transformers", "safetensors", "engines", "workloads")),
        ("reports.gate", HEAVY + ("engines", "workloads")),
        ("reports.compare", HEAVY + ("engines", "workloads")),
        ("engines.runtime.model", ("engines.quant", "harness", "workloads", "reports", "triton")),
        ("workloads", HEAVY + ("engines", "harness", "reports")),
    ],
)
def test_package_arrows(module, forbidden):
    mods = imported_after(f"import {module}")
    leaked = [m for m in forbidden if m in mods]
    assert not leaked, f"importing {module} pulled in {leaked}"
