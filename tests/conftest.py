"""Shared fixtures: tiny checkpoints (see tiny_models.py) cached for the session."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from tiny_models import build_hf_model, save_checkpoint

# Property tests draw the same examples on every CI run, so a red run reproduces locally with
# HYPOTHESIS_PROFILE=ci; elsewhere they explore (and keep failures in .hypothesis/).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# The Ctrl-C tests send SIGINT to a pwbench subprocess. A shell starts a background job (`... &`) with
# SIGINT ignored, exec keeps an ignored signal ignored, and Python then installs no KeyboardInterrupt
# handler: the child would run on and the tests fail. Seen once here on 2026-12-04, the slow step run
# as `nohup ... &`. A handled (not ignored) SIGINT is reset to the default at exec, so children get theirs.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need CUDA: skipped, with the reason, on a machine without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(arch, layout="per_expert", **overrides) -> folder; cached per session."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("ckpt")

    def make(arch: str, layout: str = "per_expert", **overrides) -> Path:
        key = (arch, layout, repr(sorted(overrides.items())))  # repr: overrides may hold dicts
        if key not in cache:
            name = f"{arch}-{layout}-{len(cache)}"
            cache[key] = save_checkpoint(build_hf_model(arch, **overrides), root / name, layout)
        return cache[key]

    return make


@pytest.fixture
def copy_checkpoint(tmp_path):
    """Copy a checkpoint folder somewhere a test may damage it."""

    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return copy
