"""`trace info --json` on every real trace, checked against numbers pandas computes from the raw file.

The oracle reads each file with pandas (or json for RAGPulse's blank line), never with
pwbench's readers, and applies the format's documented rules (ms timestamps, wall clock,
failed BurstGPT rows). Integer-derived statistics must match exactly.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from harness.cli.trace import trace_app


def info_json(path) -> dict:
    result = CliRunner().invoke(trace_app, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def expected(fmt: str, frame: pd.DataFrame, inp: str, out: str, duration_s: float | None, sessions=None) -> dict:
    """The reported numbers; durations are reported rounded to 100 ns (Azure's resolution)."""
    want = {"format": fmt, "requests": len(frame), "sessions": sessions}
    want["duration_s"] = None if duration_s is None else round(float(duration_s), 7)
    for key, column in (("input_tokens", inp), ("output_tokens", out)):
        values = frame[column]
        want[f"{key}_mean"] = values.mean()
        want[f"{key}_p50"] = values.quantile(0.5)
        want[f"{key}_p99"] = values.quantile(0.99)
        want[f"{key}_max"] = int(values.max())
    return want


def check(got: dict, want: dict) -> None:
    for key, value in want.items():
        assert got[key] == value, f"{key}: trace info says {got[key]!r}, pandas says {value!r}"


def block_repeat_share(id_lists: pd.Series) -> float:
    refs = id_lists.explode().dropna()
    return 1 - refs.nunique() / len(refs)


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_mooncake(real_trace, name):
    path = real_trace(f"mooncake/{name}")
    raw = pd.read_json(path, lines=True)
    got = info_json(path)
    span_s = (raw["timestamp"].max() - raw["timestamp"].min()) / 1000
    check(got, expected("mooncake", raw, "input_length", "output_length", span_s))
    assert got["prefix_repeat_share"] == pytest.approx(block_repeat_share(raw["hash_ids"]), abs=1e-12)


def test_ragpulse(real_trace):
    path = real_trace("ragpulse/0_trace.jsonl")
    raw = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    got = info_json(path.parent)  # the folder stands for its 0_trace.jsonl
    sessions = raw["session_id"].nunique()
    times = raw["timestamp"].astype(float)
    check(got, expected("ragpulse", raw, "input_length", "output_length", times.max() - times.min(), sessions))
    all_ids = raw["hash_ids"].map(lambda parts: [i for ids in parts.values() for i in ids])
    assert got["prefix_repeat_share"] == pytest.approx(block_repeat_share(all_ids), abs=1e-12)


@pytest.mark.parametrize("name", ["AzureLLMInferenceTrace_code.csv", "AzureLLMInferenceTrace_conv.csv"])
def test_azure(real_trace, name):
    path = real_trace(f"azure_llm_2023/{name}")
    raw = pd.read_csv(path)
    times = pd.to_datetime(raw["TIMESTAMP"])
    got = info_json(path)
    check(got, expected("azure", raw, "ContextTokens", "GeneratedTokens", (times.max() - times.min()).total_seconds()))
    assert got["prefix_repeat_share"] is None


@pytest.mark.parametrize("name", ["BurstGPT_1_dense_120.csv", "BurstGPT_1_span30s_120.csv"])
def test_burstgpt(real_trace, name):
    path = real_trace(f"burstgpt/{name}")
    raw = pd.read_csv(path)
    ok = raw[(raw["Request tokens"] > 0) & (raw["Response tokens"] > 0)]
    span_s = ok["Timestamp"].max() - ok["Timestamp"].min()
    check(info_json(path), expected("burstgpt", ok, "Request tokens", "Response tokens", span_s))


@pytest.mark.parametrize(
    "relative",
    [
        "sarathi_sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        "vidur_arxiv_summarization/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    ],
)
def test_length_only(real_trace, relative):
    path = real_trace(relative)
    raw = pd.read_csv(path)
    check(info_json(path), expected("lengths", raw, "num_prefill_tokens", "num_decode_tokens", None))


def test_burstgpt_failed_rows_are_counted_and_left_out(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,0,100,Conversation log\n"
        "6,ChatGPT,120,30,150,Conversation log\n"
        "9,GPT-4,80,0,80,API log\n"
    )
    got = info_json(path)
    assert (got["requests"], got["input_tokens_mean"], got["duration_s"]) == (1, 120, 0)
    assert got["dropped"] == ["2 failed requests (0 request or response tokens) left out"]


def test_convert_round_trips_through_pwbench_jsonl(real_trace, tmp_path):
    """Converting keeps every number `trace info` reports, and keeps the RAGPulse sessions and blocks."""
    source = real_trace("ragpulse/0_trace.jsonl")
    out = tmp_path / "rag.pwbench.jsonl"
    result = CliRunner().invoke(trace_app, ["convert", str(source), "--output", str(out)])
    assert result.exit_code == 0, result.output
    before, after = info_json(source), info_json(out)
    for key in ("path", "format"):
        before.pop(key), after.pop(key)
    assert after.pop("provenance") == ["converted from 0_trace.jsonl (ragpulse)"] and before.pop("provenance") == []
    assert after == before
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temp file left behind
