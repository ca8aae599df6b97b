"""`pwbench generate --model <folder>` with no `--engine` serves every architecture pwbench loads.

The default engine (`full`, engines/common/folders.py) once refused DeepSeek-V3 and gpt-oss; a
user's first command must work on any supported folder. Oracle: transformers' greedy tokens
for the same prompt (the default engine at its whole-device budget holds every expert at full
precision on these tiny models). The CLI runs in-process (typer's runner), as a user's
`pwbench` would, minus the interpreter start.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import ARCH_CASES as CASES
from tiny_models import build_hf_model
from typer.testing import CliRunner

from harness.cli import app

PROMPT = [5, 9, 14, 30, 31, 32]
NEW = 6
DEFAULT_RUN = {"deepseek_v3", "gpt_oss"}


def hf_greedy(arch: str, overrides: dict) -> list[int]:
    model = build_hf_model(arch, **overrides)
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("case", [c if c in DEFAULT_RUN else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_generate_without_engine_serves_every_architecture(case, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))
    arch, overrides = CASES[case]
    folder = checkpoints(arch, **overrides)
    result = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                                      "--max-new-tokens", str(NEW), "--ignore-eos", "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["outputs"][0]["output_ids"] == hf_greedy(arch, overrides)
