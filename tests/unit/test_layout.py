"""The house rules, read from the source (every import, also ones inside functions):
which package may import which, and the harness never compares engine names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package folder -> module prefixes its files must not import
RULES = {
    "engines/runtime": ("engines.quant", "engines.paged", "harness", "workloads", "reports"),
    "engines": ("harness", "workloads", "reports"),
    "workloads": ("engines", "harness", "reports"),
    # reports read result files: harness.results / harness.metrics and nothing that runs engines
    "reports": ("engines", "workloads", "torch", "harness.run", "harness.runner", "harness.cli"),
}


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("folder", list(RULES))
def test_package_arrows_in_source(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in RULES[folder]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_harness_never_compares_engine_names():
    """Engines say what they can do through class-level capability flags; the harness asks
    those, so a new engine needs no harness change."""
    from engines.registry import list_engines

    names = {name for name, _ in list_engines()}
    bad = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                consts = [side] if isinstance(side, ast.Constant) else list(getattr(side, "elts", []))
                hits = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
                if hits:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with engine name {hits[0]!r}")
    assert not bad, "\n".join(bad)
