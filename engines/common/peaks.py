"""`pwbench hw`'s peaks cache: hw.json in the pwbench cache folder, measurements by device name.
harness/hw.py writes it; engines read it here, so neither needs the other."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

from engines.common.folders import cache_dir


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def names_device(key: str, device_name: str) -> bool:
    """Whether `key` ("L4", "H100 PCIe") names the device `device_name` ("NVIDIA L4", "NVIDIA H100
    PCIe"): as a whole word, case-insensitive, so "L4" does not name an L40S nor "A10G" an A100."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE) is not None


def cache_path() -> Path:
    return cache_dir() / "hw.json"


def cached_peaks() -> dict[str, dict[str, Any]]:
    """`pwbench hw` measurements by device name ({} when none were taken)."""
    try:
        return json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
