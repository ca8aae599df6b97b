"""Config-only model presets (engines/sim/presets/<name>/config.json; sources in SOURCES.md).

The table is engines/common/presets.py's (so `resolve_model` knows the names without importing
the simulator); this module is where the simulator reaches it.
"""

from __future__ import annotations

from engines.common.presets import PRESETS, PRESETS_DIR, preset_path

__all__ = ["PRESETS", "PRESETS_DIR", "preset_path"]
