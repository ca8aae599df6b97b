"""The harness's user error. Errors a user can fix are one `error:` line with exit code 2, never a
traceback (harness/cli/common.py lists them: EngineError from engines/base.py, WorkloadError
from workloads/base.py, and HarnessError here). Importing this imports nothing else, so
result readers (reports/) stay free of engines and workloads."""

from __future__ import annotations


class HarnessError(Exception):
    """A run-level problem the user can fix (output folder, options); shown as one line."""
