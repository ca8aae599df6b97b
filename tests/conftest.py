"""Shared fixtures: tiny checkpoints (see tiny_models.py) cached for the session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tiny_models import build_hf_model, save_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(arch, layout="per_expert", **overrides) -> folder; cached per session."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("ckpt")

    def make(arch: str, layout: str = "per_expert", **overrides) -> Path:
        key = (arch, layout, tuple(sorted(overrides.items())))
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
