"""`python -m harness.bench.recording`: the recording's own time per decode step, timed inside its hooks."""

from __future__ import annotations

import re

import pytest

from harness.bench.recording import main, measure


def test_recording_time_is_part_of_the_step(capsys):
    from engines.common.demo import demo_model_path

    step, recording, layers = measure(str(demo_model_path()), 2, 48, 1)
    assert layers == 2  # the bundled model's MoE layers, each recorded every step
    assert 0.0 < recording < step
    assert main(["--batches", "1", "--context", "48"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"demo_model, 1 x 48 tokens, 2 MoE layers: decode step [\d.]+ ms, of which recording "
                        r"routing [\d.]+ us \([\d.]+%\)", line), line


def test_a_folder_without_config_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no config.json there"):
        main(["--model", str(tmp_path)])
