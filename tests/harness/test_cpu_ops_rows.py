"""harness/bench/cpu_ops.py: the GEMM times `pwbench hw calibrate --model` fits the cost model's
shape-keyed curves on, by row count, and `--rows`, which prints them."""

from __future__ import annotations

from engines.common.demo import demo_model_path
from engines.runtime import gemm
from harness.bench.cpu_ops import MODEL_ROWS, main


def test_every_row_count_below_the_packed_kernel_is_timed():
    """Below gemm.MIN_ROWS the runtime calls F.linear, whose float32 kernel here takes the rows in
    blocks (a staircase in the rows): a curve interpolated between powers of two misprices the rows
    between them, so each part is timed at every row count up to the packed kernel's."""
    for part, rows in MODEL_ROWS.items():
        assert set(range(1, gemm.MIN_ROWS + 1)) <= set(rows), part
        assert list(rows) == sorted(set(rows)), part


def test_rows_table_prints_each_part_by_rows(capsys):
    assert main(["--rows", "--rounds", "1", "--models", str(demo_model_path())]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.split()[:1] == ["rows"])
    # and an expert's GEMMs right after its dequantization (static-* on the CPU)
    assert out[header].split() == ["rows", *MODEL_ROWS, "dequantized"]
    table = [line.split() for line in out[header + 1:]]
    assert [int(r[0]) for r in table] == [*range(1, 17), 32]
    assert all(len(r) == 2 + len(MODEL_ROWS) and all(float(x) > 0 for x in r[1:]) for r in table)


def test_rows_table_refuses_a_folder_without_a_config(tmp_path, capsys):
    assert main(["--rows", "--models", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(tmp_path) in out[0] and "config.json" in out[0]
