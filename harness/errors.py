"""The harness's user error. Errors a user can fix are one `error:` line with exit code 2, never a
traceback (harness/cli/common.py lists them: EngineError from engines/base.py, WorkloadError
from workloads/base.py, and HarnessError here). Importing this imports nothing else, so
result readers (reports/) stay free of engines and workloads."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


class HarnessError(Exception):
    """A run-level problem the user can fix (output folder, options); shown as one line."""


def read_toml(path: str | Path, what: str, keys: Iterable[str]) -> dict[str, Any]:
    """A user's TOML file (a gate policy, a sweep grid) whose top-level keys must be among
    `keys`; every problem is a HarnessError naming the file and, where there is one, the key."""
    import tomllib  # noqa: PLC0415

    path, keys = Path(path), list(keys)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HarnessError(f"{path}: no such {what} file") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"{path}: invalid TOML ({exc})") from None
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise HarnessError(f"{path}: unknown key {unknown[0]!r}; valid: {', '.join(keys)}")
    return data
