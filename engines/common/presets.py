"""Config-only model presets for `--simulate`: a public checkpoint's config.json, no weights.

    engines/sim/presets/<name>/config.json    sources: engines/sim/presets/SOURCES.md

The table lives here, not in engines/sim, so that `resolve_model` (engines/common/demo.py)
turns a preset's name into its folder without importing the simulator.
"""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parents[1] / "sim" / "presets"
PRESETS: dict[str, Path] = {p.name: p for p in sorted(PRESETS_DIR.iterdir()) if (p / "config.json").is_file()} \
    if PRESETS_DIR.is_dir() else {}


def preset_path(name: str) -> Path:
    """The folder of preset `name` (ValueError naming the presets when there is none)."""
    if name not in PRESETS:
        raise ValueError(f"no model preset is called {name!r}; presets: {', '.join(PRESETS) or 'none installed'}")
    return PRESETS[name]
