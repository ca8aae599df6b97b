"""Engine `openai` against a fake server that ignores fixed lengths (the common trap) and
against nothing at all: the trap is reported in the engine's notes, an unreachable server is
a one-line error before anything runs."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest
from serving import ROOT, free_port

from engines.base import EngineError, EngineRequest
from engines.remote import OpenAIEngine, OpenAIEngineConfig
from harness.bench.openai_client import _fake_server
from harness.offline import run_offline


@pytest.fixture(scope="module")
def fake_port():
    ports: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=_fake_server, args=(ports, 5), daemon=True)  # always 5 tokens
    proc.start()
    yield ports.get(timeout=30)
    proc.terminate()
    proc.join(10)


def test_a_server_that_ignores_fixed_lengths_is_reported(fake_port):
    engine = OpenAIEngine(OpenAIEngineConfig(base_url=f"http://127.0.0.1:{fake_port}/v1", vocab_size=100))
    engine.start()
    try:
        outs = []
        done = run_offline(engine, [EngineRequest("a", (1, 2, 3), 8, ignore_eos=True), EngineRequest("b", (4,), 5)],
                           on_step=lambda s: outs.extend(s.outputs))
        notes = engine.notes()
    finally:
        engine.stop()
    # The fake server's ids are 5 + i % 90 for the i-th chunk, one token per chunk.
    assert done["a"].output_ids == [5, 6, 7, 8, 9] and done["b"].output_ids == [5, 6, 7, 8, 9]
    times = [t for o in outs if o.request_id == "a" for t in o.token_times]
    assert len(times) == 5 and times == sorted(times)
    assert any(n.startswith("1 of 1 fixed-length requests came back with another length") for n in notes)
    assert any("client overhead" in n for n in notes)
    assert engine.info().unavailable["transfers"].startswith("remote server")


def test_unreachable_server_is_one_line_error():
    port = free_port()  # nothing listens there
    engine = OpenAIEngine(OpenAIEngineConfig(base_url=f"http://127.0.0.1:{port}/v1"))
    with pytest.raises(EngineError, match=rf"cannot reach http://127.0.0.1:{port}/v1/models: .*is the server running"):
        engine.start()
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--engine", "openai", "--set",
                           f"base_url=http://127.0.0.1:{port}/v1", "--requests", "2", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot reach")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("option, fragment", [("endpoint=grpc", "'endpoint' must be completions or chat"),
                                              ("fixed_length=always", "'fixed_length' must be one of")])
def test_bad_options(option, fragment):
    from engines.registry import create_engine, parse_set_options

    with pytest.raises(EngineError, match=fragment):
        create_engine("openai", parse_set_options([option]))
