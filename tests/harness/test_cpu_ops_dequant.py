"""harness/bench/cpu_ops.py `--dequant`: the CPU reference's dequantization of one expert, as
`pwbench hw calibrate --model` times it, with the engines' host-memory setting and with glibc's."""

from __future__ import annotations

from engines.common.demo import demo_model_path
from harness.bench.cpu_ops import dequant_rows, main
from harness.hw import DEQUANT_BITS


def test_dequant_rows_run_each_setting_in_its_own_process():
    demo = str(demo_model_path())
    rows = dequant_rows([demo], 1)
    # The bundled model: hidden 128, expert intermediate 64 -> the static engines' group 128 does not
    # divide 64, 64 does; one expert is gate_up [128, 128] + down [128, 64] float32 = 98,304 bytes.
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("demo_model", "kept", 64, 98_304),
                                                        ("demo_model", "glibc", 64, 98_304)]
    for *_, seconds in rows:
        assert sorted(seconds, key=int) == [str(b) for b in DEQUANT_BITS]
        assert all(0 < s < 1 for s in seconds.values())


def test_dequant_table_refuses_a_folder_without_a_config(tmp_path, capsys):
    assert main(["--dequant", "--models", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(tmp_path) in out[0] and "config.json" in out[0]
