"""`pwbench trace formats` and `pwbench demo tasks`, run as the `pwbench` command runs them
(`python -m harness.cli`, a fresh interpreter): exit 0, and their output checked against the
registries (workloads.traces.formats, harness.lmeval.tasks.DEMO_TASKS), the README's list of
formats, and the demo language's facts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from harness.lmeval.tasks import DEMO_TASKS
from workloads.demo.language import demo_language
from workloads.traces.formats import list_formats
from workloads.traces.generic import GENERIC_FORMATS

REPO = Path(__file__).resolve().parents[2]
README_FORMATS = {"mooncake", "ragpulse", "azure", "burstgpt", "lengths", "pwbench"}  # README "Trace formats"


def pwbench(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def test_trace_formats_lists_every_registered_format():
    proc = pwbench("trace", "formats")
    lines = proc.stdout.splitlines()
    registry = list_formats()
    assert {name for name, _ in registry} == README_FORMATS
    # one line each: the fixed formats sorted, then your own layouts with --map
    listed = [*registry, *((f"{name} --map", text) for name, text in GENERIC_FORMATS.items())]
    assert [line.split()[0] for line in lines] == [*sorted(README_FORMATS), "jsonl", "csv"]
    width = max(len(name) for name, _ in listed)
    for line, (name, description) in zip(lines, listed, strict=True):
        assert line == f"{name.ljust(width)}  {description}", line
    assert proc.stderr == ""


def test_demo_tasks_writes_every_registered_task(tmp_path):
    out = tmp_path / "tasks"
    proc = pwbench("demo", "tasks", "--output", str(out), "--samples", "3")
    named, _, folder = proc.stdout.strip().splitlines()[-1].removeprefix("wrote ").rpartition(" to ")
    assert folder == str(out.resolve())
    assert sorted(named.split(", ")) == sorted(DEMO_TASKS)  # each task named, none extra
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.{ext}" for n in DEMO_TASKS
                                                           for ext in ("jsonl", "yaml"))

    lang = demo_language()
    for name, task in DEMO_TASKS.items():
        config = yaml.safe_load((out / f"{name}.yaml").read_text())
        data = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert config["task"] == name and data == (out / f"{name}.jsonl").resolve() and data.is_absolute()
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        assert rows and all(r["prompt"] and r["answer"] for r in rows)
        longest = max(len(r["answer"].split()) for r in rows)
        assert config["generation_kwargs"]["max_gen_toks"] == longest + 2
        for r in rows:  # the prompt's words exist in the demo language; the answer is right
            assert all(w in lang.token_to_id for w in r["prompt"].split() + r["answer"].split()), r
            if task == "closed_book":
                attr, entity = re.fullmatch(r"question : the (\w+) of (\w+ \w+)", r["prompt"]).groups()
                assert lang.book_facts[(entity, attr)] == r["answer"]
            elif task == "copy":
                words = r["answer"].split()
                assert r["prompt"].split()[2 : 2 + len(words)] == words
            else:  # recall: the fact the question asks about is stated in the prompt, once
                attr, entity = re.search(r"(?:question|user) : the (\w+) of (\w+)$", r["prompt"]).groups()
                assert re.findall(rf"the {attr} of {entity} (\w+) \.", r["prompt"]) == [r["answer"]]
        if task != "closed_book":  # closed book asks a fixed share of all facts
            assert len(rows) == 3
