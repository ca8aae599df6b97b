"""What a run leaves when it does not end well: every request finished before a SIGKILL, an
exception, or a failed final write is on disk in the hidden partial folder, marked incomplete,
and nothing there looks like a complete result folder.

The dummy engine with max_num_seqs=1 serves the offline requests one after another, M steps
each, so after S steps exactly S // M requests have finished, in request order: that count,
worked out by hand, is the oracle for the in-process cases; the SIGKILL case checks the file
against the runner's own progress count printed before the kill.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.results import PARTIAL_MARKER, REQUESTS_STREAM, partial_folder, read_partial, read_run
from harness.run import RunArgs, execute
from workloads.registry import WorkloadSpec

TOKENS = 4  # output tokens a request, so steps a request with max_num_seqs=1


def args_for(out: Path, requests: int = 12) -> RunArgs:
    spec = WorkloadSpec("offline_batch", requests=requests, input_tokens=8, output_tokens=TOKENS)
    return RunArgs(workload=spec, given=frozenset({"requests", "input_tokens", "output_tokens"}), engine="dummy",
                   engine_options={"max_num_seqs": 1}, output=str(out), warmup=0, quality=False,
                   telemetry_hz=1.0)


def partials(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial-")]


def assert_prefix_of_finished(rows: list[dict], count: int) -> None:
    """`rows` are exactly the first `count` requests, each finished with all its tokens."""
    assert [r["request_id"] for r in rows] == [f"offline_batch-{i:05d}" for i in range(count)]
    for r in rows:
        assert r["finish_s"] is not None and r["error"] is None and r["finish_reason"] == "length"
        assert r["output_tokens"] == TOKENS and len(r["token_times_s"]) == TOKENS == len(r["output_ids"])


@pytest.mark.parametrize("steps", [1, 10, 13])
def test_an_exception_mid_run_keeps_every_finished_request(tmp_path, steps, capsys):
    """A KeyboardInterrupt out of the step callback after `steps` steps (a second Ctrl-C) ends
    the run; the partial folder keeps steps // TOKENS requests, or is gone when none finished."""
    out = tmp_path / "run"
    seen = []

    def on_step(records) -> None:
        seen.append(1)
        if len(seen) == steps:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(args_for(out), on_step=on_step)
    assert not out.exists()
    finished = steps // TOKENS
    if finished == 0:
        assert partials(out) == [] and capsys.readouterr().err == ""
        return
    [folder] = partials(out)
    marker, rows = read_partial(folder)
    assert marker["status"] == "incomplete" and marker["error"] == "KeyboardInterrupt: "
    assert marker["target"] == str(out) and not (folder / "run.json").exists()
    assert_prefix_of_finished(rows, finished)
    err = capsys.readouterr().err
    assert f"the {finished} measured requests are kept in {folder / REQUESTS_STREAM}" in err
    with pytest.raises(HarnessError, match="is an incomplete run"):
        read_run(folder)


def test_a_failed_final_write_keeps_the_rows_and_says_where(tmp_path):
    """A folder named requests.parquet where the file must go (a real write error, for root
    too): the run's end raises one HarnessError naming the partial folder, which keeps all
    12 requests, marked incomplete."""
    out = tmp_path / "run"

    def block(records) -> None:
        (partial_folder(out) / "requests.parquet").mkdir(exist_ok=True)

    with pytest.raises(HarnessError) as caught:
        execute(args_for(out), on_step=block)
    folder = partial_folder(out)
    message = str(caught.value)
    assert "\n" not in message and f"could not write the result files into {folder}" in message
    assert f"the 12 measured requests are kept there in {REQUESTS_STREAM}" in message
    marker, rows = read_partial(folder)
    assert marker["status"] == "incomplete" and not out.exists() and not (folder / "run.json").exists()
    assert_prefix_of_finished(rows, 12)


def test_a_failed_rename_says_the_complete_folder_is_kept(tmp_path):
    """Someone fills the target during the run: the folder cannot be renamed onto it; the
    complete result (run.json and all) stays in the hidden folder, and the error says so."""
    out = tmp_path / "run"

    def squat(records) -> None:
        out.mkdir(exist_ok=True)
        (out / "theirs").write_text("x")

    with pytest.raises(HarnessError, match="it is complete: move it yourself"):
        execute(args_for(out), on_step=squat)
    folder = partial_folder(out)
    assert read_run(folder)["summary"]["completed"] == 12 and not (folder / PARTIAL_MARKER).exists()
    assert [p.name for p in out.iterdir()] == ["theirs"]


def test_a_complete_run_leaves_no_stream_behind(tmp_path):
    """The streams are the parquet files' source and are gone once the folder is in place."""
    out = tmp_path / "run"
    folder, run = execute(args_for(out))
    assert {p.name for p in folder.iterdir()} == {"run.json", "requests.parquet", "steps.parquet",
                                                 "telemetry.parquet"}
    assert run["summary"]["completed"] == 12 and run["summary"]["engine"]["steps"] == 12 * TOKENS
    assert partials(out) == []


PROGRESS = re.compile(r"^run: (\d+)/400 requests done")


def test_sigkill_mid_run_leaves_every_finished_request_marked_incomplete(tmp_path):
    """A real SIGKILL to `pwbench run` once its progress line says D requests are done: the
    partial folder (named by the killed process's pid) holds the first k >= D requests, each
    complete, marked incomplete; no result folder exists; `pwbench show` on it is one line."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(tmp_path / "cache")}
    # 400 requests one at a time, 4 steps of >= 2 ms each: >= 3 s of run; a progress line
    # each time another 40 requests finished.
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--engine", "dummy", "--workload",
                             "offline_batch", "--requests", "400", "--input-len", "8", "--output-len", str(TOKENS),
                             "--set", "base_ms=2", "--set", "max_num_seqs=1", "--warmup", "0", "--no-quality",
                             "--output", str(out)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    done = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if match := PROGRESS.match(line):
                done = int(match.group(1))
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert done is not None and done >= 40, "no progress line before the deadline"
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    [folder] = partials(out)
    assert folder.name == f".run.partial-{proc.pid}"
    marker, rows = read_partial(folder)
    assert marker["status"] == "incomplete" and marker["pid"] == proc.pid
    assert done <= len(rows) < 400
    assert_prefix_of_finished(rows, len(rows))
    show = subprocess.run([sys.executable, "-m", "harness.cli", "show", str(folder)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert show.returncode == 2 and len(show.stderr.splitlines()) == 1 and str(folder) in show.stderr
    with pytest.raises(HarnessError, match="is an incomplete run"):
        read_run(folder)


def test_a_full_disk_mid_run_stops_the_run_and_keeps_what_was_written(tmp_path):
    """After step 10 the stream's file descriptor is pointed at /dev/full (writes fail with
    ENOSPC, as on a full disk): the next request's row cannot be written, the run stops, and
    the error (one line) says that the 10 // TOKENS requests measured before are kept."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    out = tmp_path / "run"
    seen = []

    def fill_disk(records) -> None:
        seen.append(1)
        if len(seen) == 10:
            folder = partial_folder(out)
            [fd] = [int(f.name) for f in Path("/proc/self/fd").iterdir()
                    if os.path.realpath(f) == str(folder / REQUESTS_STREAM)]
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, fd)
            os.close(full)

    with pytest.raises(HarnessError) as caught:
        execute(args_for(out, requests=40), on_step=fill_disk)
    folder = partial_folder(out)
    message = str(caught.value)
    assert "\n" not in message
    assert f"could not append to {folder / REQUESTS_STREAM} (No space left on device)" in message
    assert f"the {10 // TOKENS} requests measured before are kept there" in message
    marker, rows = read_partial(folder)
    assert marker["status"] == "incomplete" and "No space left on device" in marker["error"]
    assert_prefix_of_finished(rows, 10 // TOKENS) and not out.exists()


def test_a_stream_reads_back_as_written_across_batches(tmp_path, monkeypatch):
    """Batches of 2 rows: a column null in the first batch and text in the next, whole numbers
    then fractions, empty lists then floats, and a last line cut short by a kill (left out)."""
    import json

    from harness import results

    monkeypatch.setattr(results, "STREAM_BATCH", 2)
    rows = [{"request_id": "a", "error": None, "arrival_s": 0, "token_times_s": []},
            {"request_id": "b", "error": None, "arrival_s": 1, "token_times_s": []},
            {"request_id": "c", "error": "interrupted", "arrival_s": 1.5, "token_times_s": [0.25, 0.5]},
            {"request_id": "d", "error": None, "arrival_s": 2, "token_times_s": [1e-9]}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"request_id": "e", "err')
    assert results.read_stream(path).to_pylist() == rows
