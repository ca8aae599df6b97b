"""The README's tour is the map of the tree: every Python module of the packages is listed, and
every listed file exists (so a move or a new module without its map line fails here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "engines", "workloads", "reports")


def tour_paths() -> set[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## A short tour", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines()[1:]:
        m = re.match(r"^((?:│   |    )*)(?:├── |└── )(\S+)", line)
        if m:
            depth = len(m.group(1)) // 4
            stack = stack[:depth] + [m.group(2).rstrip("/")]
            paths.add("/".join(stack))
    return paths


def docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def test_tour_lists_every_module_and_nothing_else():
    listed = tour_paths()
    modules = {
        str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
        if "__pycache__" not in p.parts and not (p.name == "__init__.py" and docstring_only(p))
    }
    assert sorted(modules - listed) == [], "modules missing from the README tour"
    gone = sorted(p for p in listed if not (ROOT / p).exists())
    assert gone == [], "the README tour lists files that do not exist"
