"""Session fixtures for the report and gate tests: dummy-engine runs (fast) and one small real
`moe` run on the bundled demo model."""

from __future__ import annotations

import pytest
from result_folders import make_run


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """A suite-like folder: moe (real, demo model, 6 requests half closed-book) and two dummy
    engines of different speeds."""
    root = tmp_path_factory.mktemp("suite")
    make_run(root / "moe", "moe", device="cpu", dtype="float32")
    make_run(root / "dummy-fast", decode_ms_per_token=0.5)
    make_run(root / "dummy-slow", decode_ms_per_token=3.0)
    return root
