"""The house rules, read from the source (every import, also ones inside functions):
which package may import which, and no code outside the engine registry names engines (no
comparison with an engine name, no module-level collection of engine names)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One folder per technique (its engine, parts and planning); recipes at the top combine them.
TECHNIQUE_FOLDERS = ("offload", "pagedweight", "moegen")
TECHNIQUES = tuple(f"engines.{t}" for t in TECHNIQUE_FOLDERS)
RECIPES = ("engines.moe", "engines.full", "engines.static_quant")

# package folder -> module prefixes its files must not import
RULES = {
    # the runtime is the parts every engine is assembled from: it knows no technique
    "engines/runtime": ("engines.quant", *TECHNIQUES, *RECIPES, "harness", "workloads", "reports"),
    # a technique folder stands alone; only recipes (engines/full.py) combine techniques
    **{f"engines/{t}": tuple(f"engines.{o}" for o in TECHNIQUE_FOLDERS if o != t) + RECIPES
       for t in TECHNIQUE_FOLDERS},
    # the simulator is a part like the runtime's: it drives any technique through runtime seams
    "engines/sim": ("engines.quant", *TECHNIQUES, *RECIPES, "harness", "workloads", "reports"),
    # the light helpers the harness may import know no engine part
    "engines/common": ("engines.runtime", "engines.quant", *TECHNIQUES, *RECIPES),
    "engines": ("harness", "workloads", "reports"),
    "workloads": ("engines", "harness", "reports"),
    # reports read result files: harness.results / harness.metrics and nothing that runs engines
    "reports": ("engines", "workloads", "torch", "harness.run", "harness.runner", "harness.cli"),
    # the harness measures and writes result files; only its CLI puts results and reports together
    "harness": ("reports",),
}
# package folder -> subfolders its rule does not cover
EXEMPT = {"harness": ("harness/cli",)}

# Where engine names may be written down: the registry, which resolves them.
NAME_FOLDERS = ("harness", "engines", "reports", "workloads")
NAME_ALLOWED = ("engines/registry.py",)
COLLECTIONS = (ast.Tuple, ast.List, ast.Set, ast.Dict)
# Attributes whose values only share a word with an engine's name (a "full" q/k norm).
NOT_ENGINE_NAMES = ("qk_norm",)


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
        if any(path.is_relative_to(ROOT / exempt) for exempt in EXEMPT.get(folder, ())):
            continue
        for line, name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in RULES[folder]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def _engine_names_in(node: ast.AST, names: set[str]) -> list[str]:
    return [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]


def _is_collection(value: ast.AST | None) -> bool:
    """A tuple/list/set/dict literal, or frozenset(...)/set(...)/tuple(...)/... of one."""
    if isinstance(value, COLLECTIONS):
        return True
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("frozenset", "set", "tuple", "list", "dict", "MappingProxyType"))


def _names_other_thing(node: ast.Compare) -> bool:
    return any(isinstance(side, ast.Attribute) and side.attr in NOT_ENGINE_NAMES
               for side in [node.left, *node.comparators])


def engine_name_uses(path: Path, names: set[str]) -> list[str]:
    """Comparisons with an engine name anywhere in the file, and module-level collections
    that hold one (class attributes such as `name = "moe"` are neither)."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and not _names_other_thing(node):
            for side in [node.left, *node.comparators]:
                consts = [side] if isinstance(side, ast.Constant) else list(getattr(side, "elts", []))
                hits = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
                if hits:
                    bad.append(f"{where}:{node.lineno} compares with engine name {hits[0]!r}")
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _is_collection(stmt.value):
            hits = _engine_names_in(stmt.value, names)
            if hits:
                target = ast.unparse(stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target)
                bad.append(f"{where}:{stmt.lineno} module-level collection {target} holds engine name {hits[0]!r} "
                           f"(only {', '.join(NAME_ALLOWED)} lists engines)")
    return bad


@pytest.mark.parametrize("folder", NAME_FOLDERS)
def test_harness_never_compares_engine_names(folder):
    """Engines say what they can do through class-level capability flags; the harness asks
    those, so a new engine needs no harness change. Nor do engines single each other out by
    name, and reports and workloads know no engine: only the registry lists them."""
    from engines.registry import list_engines

    names = {name for name, _ in list_engines()}
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if str(path.relative_to(ROOT)) not in NAME_ALLOWED:
            bad += engine_name_uses(path, names)
    assert not bad, "\n".join(bad)
