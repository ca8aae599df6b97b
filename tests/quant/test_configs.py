"""Kernel settings as data: file names, nearest-batch lookup, fallbacks and bad files."""

from __future__ import annotations

import json

import pytest
import torch

from engines.quant.configs import (
    INTERPRETER_CONFIG,
    KernelConfig,
    config_file_name,
    default_config,
    load_table,
    pick_config,
    write_table,
)
from engines.quant.qweight import QuantFormatError

CPU = torch.device("cpu")


@pytest.fixture
def compiled(monkeypatch):
    """Look up configs as a compiled (non-interpreter) run would."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    yield
    load_table.cache_clear()


def test_file_name_is_keyed_by_shape_device_and_dtype():
    name = config_file_name(8, 28672, 4096, 4, 128, "NVIDIA_H200", torch.bfloat16)
    assert name == "E=8,N=28672,K=4096,bits=4,group_size=128,device_name=NVIDIA_H200,dtype=bfloat16.json"


def test_nearest_batch_size_from_a_file(compiled, tmp_path):
    small, large = KernelConfig(16, 64, 128, 4, 3), KernelConfig(64, 128, 64, 8, 4)
    write_table(tmp_path / config_file_name(8, 256, 128, 4, 64, "cpu", torch.float32), {8: small, 512: large})
    pick = lambda m: pick_config(8, 256, 128, 4, 64, torch.float32, m, CPU, config_dir=tmp_path)  # noqa: E731
    assert pick(1) == KernelConfig(16, 64, 64, 4, 3)  # block_k clamped to the group size
    assert pick(200) == KernelConfig(16, 64, 64, 4, 3)
    assert pick(300) == large
    assert pick(100_000) == large
    # another shape, dtype or device has no file: the size-based default
    assert pick_config(8, 256, 128, 4, 64, torch.float16, 300, CPU, config_dir=tmp_path) == default_config(300)


def test_interpreter_always_gets_its_one_config(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    write_table(tmp_path / config_file_name(1, 64, 64, 4, 32, "cpu", torch.float32), {1: KernelConfig(64, 64, 64)})
    assert pick_config(1, 64, 64, 4, 32, torch.float32, 1, CPU, config_dir=tmp_path) == INTERPRETER_CONFIG


def test_bad_files_and_configs_are_one_line_errors(compiled, tmp_path):
    path = tmp_path / config_file_name(1, 64, 64, 4, 32, "cpu", torch.float32)
    path.write_text("{not json")
    with pytest.raises(QuantFormatError, match="invalid JSON at line 1"):
        pick_config(1, 64, 64, 4, 32, torch.float32, 1, CPU, config_dir=tmp_path)
    load_table.cache_clear()
    path.write_text(json.dumps({"16": {"block_m": 16, "block_n": 64}}))
    with pytest.raises(QuantFormatError, match="bad entry.*values have block_m, block_n, block_k"):
        pick_config(1, 64, 64, 4, 32, torch.float32, 1, CPU, config_dir=tmp_path)
    with pytest.raises(QuantFormatError, match="KernelConfig.block_n: must be a power of two >= 16, got 48"):
        KernelConfig(16, 48, 32)
