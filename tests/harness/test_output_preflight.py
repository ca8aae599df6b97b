"""The output folder is checked before anything loads: a path that cannot take a result folder
(read-only, under a file, a mount point, a disk without room) is one `error:` line and exit 2,
before the engine or the model is touched, and leaves nothing behind.

Which check ran first is shown without timing anything: the runs below also name a model
folder that does not exist, so a check made after the model load would report the model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.results import BYTES_PER_REQUEST, check_output, partial_folder


def pwbench(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


MISSING_MODEL = "/nonexistent/pwbench-model"  # loading it would fail with its own message


def test_a_path_under_a_file_fails_before_the_model_loads(tmp_path):
    """Fails for root too: nothing can be created under a regular file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "run"
    proc = pwbench("run", "--engine", "moe", "--model", MISSING_MODEL, "--workload", "offline_batch",
                   "--requests", "2", "--output", str(out), cache=tmp_path / "cache")
    one_error_line(proc, str(out), f"lies under {blocker}, which is a file", "choose another --output")
    assert MISSING_MODEL not in proc.stderr  # the model was never opened
    assert blocker.read_text() == "x" and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nobody can write in: a 0o555 folder, or for root (whom modes do not stop) a
    read-only tmpfs mounted for the test (skipped where this machine refuses the mount)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("root, and this machine refuses to mount a read-only tmpfs")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_read_only_folder_fails_before_the_model_loads(read_only_dir, tmp_path):
    ro = read_only_dir
    out = ro / "run"
    proc = pwbench("run", "--engine", "moe", "--model", MISSING_MODEL, "--workload", "offline_batch",
                   "--requests", "2", "--output", str(out), cache=tmp_path / "cache")
    one_error_line(proc, str(out), f"cannot write in {ro}", "choose a writable --output")
    assert list(ro.iterdir()) == []


def test_not_enough_free_space_fails_before_the_model_loads(tmp_path):
    """The estimate (BYTES_PER_REQUEST a request) for 10^12 requests exceeds any real disk."""
    out = tmp_path / "run"
    free = shutil.disk_usage(tmp_path).free
    requests = free // BYTES_PER_REQUEST + 1
    proc = pwbench("run", "--engine", "moe", "--model", MISSING_MODEL, "--workload", "offline_batch",
                   "--requests", str(requests), "--output", str(out), cache=tmp_path / "cache")
    one_error_line(proc, str(out), "MiB free, this run needs about", "free some space or choose another --output")
    assert not out.exists() and not partial_folder(out).exists()


def test_a_mount_point_is_refused_for_a_run_but_not_for_a_suite(tmp_path, monkeypatch):
    """A run's folder is renamed into place, which cannot replace a mount point; the suite's
    folder is written in place, so it may be one. (The mount is the one thing faked here: the
    test cannot mount a file system.)"""
    mount = tmp_path / "mnt"
    mount.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount)
    with pytest.raises(HarnessError, match=f"{mount} is a mount point.*--output {mount / 'run1'}"):
        check_output(mount)
    check_output(mount, renamed=False)
    check_output(mount / "run1")


def test_the_suite_checks_its_folder_before_it_loads_a_model(tmp_path):
    """`pwbench run` with several engines (no --engine): the suite folder under a file fails
    before the default budget's engine loads the (missing) model."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "suite"
    proc = pwbench("run", "--workload", "rag_long", "--model", MISSING_MODEL, "--requests", "2",
                   "--output", str(out), cache=tmp_path / "cache")
    one_error_line(proc, str(out), f"lies under {blocker}, which is a file")
    assert MISSING_MODEL not in proc.stderr


def test_a_good_path_is_created_and_left_clean(tmp_path):
    """The check makes the parent folders and leaves no test file behind."""
    out = tmp_path / "a" / "b" / "run"
    check_output(out, need_bytes=1)
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
