"""`pwbench generate` without --model serves the bundled demo model, as `run` and `serve` do:
the same tokens as with the demo folder's path given (CLI in-process)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from engines.common.demo import DEMO_MODEL_DIR
from harness.cli import app


def test_generate_defaults_to_the_bundled_model():
    args = ["generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos", "--json", "--device", "cpu"]
    default = CliRunner().invoke(app, args)
    assert default.exit_code == 0, default.output
    given = CliRunner().invoke(app, [*args, "--model", str(DEMO_MODEL_DIR)])
    assert given.exit_code == 0, given.output
    out = json.loads(default.stdout.splitlines()[-1])["outputs"]
    assert out == json.loads(given.stdout.splitlines()[-1])["outputs"]
    assert len(out[0]["output_ids"]) == 4 and "text" in out[0]  # the demo folder's tokenizer decoded it
