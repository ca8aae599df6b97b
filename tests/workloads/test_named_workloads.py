"""Named workloads: the light registry, options checking, each workload's shape against the
real trace it imitates (read here with pandas/json), scale, bounds and max_model_len.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from workloads.base import WorkloadError
from workloads.registry import ModelTarget, WorkloadSpec, build_workload, list_workloads, parse_length_range
from workloads.reuse import repeated_prefix_tokens

TARGET = ModelTarget(vocab_size=1000, max_model_len=10**6, special_ids=(0, 1, 2))
NAMES = ["rag_long", "long_chat", "agentic", "offline_batch", "burst"]


def build(name: str, target: ModelTarget = TARGET, **options):
    return build_workload(WorkloadSpec(name, **options), target)


def test_listing_and_base_import_nothing_heavy():
    code = (
        "import sys\nfrom workloads.registry import list_workloads\nfrom workloads.base import Request\n"
        "rows = list_workloads()\nprint(len(rows), *(m for m in ('numpy', 'pandas', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["6"]
    assert [name for name, _ in list_workloads()] == sorted(NAMES + ["trace:PATH"])


@pytest.mark.parametrize("name", NAMES)
def test_every_workload_fits_the_target(name):
    target = ModelTarget(vocab_size=500, max_model_len=1024, special_ids=(0, 2))
    workload = build(name, target, requests=40, scale=0.5)
    ids = [r.request_id for r in workload.requests]
    assert len(workload.requests) == 40 and len(set(ids)) == 40
    for r in workload.requests:
        assert r.num_prompt_tokens + r.max_new_tokens <= 1024 and r.max_new_tokens >= 1
        assert min(r.prompt_ids) >= 0 and max(r.prompt_ids) < 500 and not {0, 2} & set(r.prompt_ids)
        covered = (sum(r.block_lengths) if r.block_lengths
                   else min(len(r.prefix_blocks) * r.block_tokens, r.num_prompt_tokens))
        assert covered <= r.num_prompt_tokens


def ragpulse_rows(real_trace) -> pd.DataFrame:
    path = real_trace("ragpulse/0_trace.jsonl")
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def test_rag_long_is_shaped_like_ragpulse(real_trace):
    raw = ragpulse_rows(real_trace)
    requests = build("rag_long", requests=1500, seed=1).requests
    inputs = pd.Series([r.num_prompt_tokens for r in requests])
    outputs = pd.Series([r.max_new_tokens for r in requests])
    assert inputs.median() == pytest.approx(raw["input_length"].median(), rel=0.1)
    assert outputs.median() == pytest.approx(raw["output_length"].median(), rel=0.15)
    in_band = inputs.between(2000, 8000).mean()
    assert in_band == pytest.approx(raw["input_length"].between(2000, 8000).mean(), abs=0.08)
    turns = pd.Series([r.session_id for r in requests]).value_counts()
    raw_turns = raw["session_id"].value_counts()
    assert turns.mean() == pytest.approx(raw_turns.mean(), rel=0.2)
    blocks = [b for r in requests for b in r.prefix_blocks]
    raw_ids = raw["hash_ids"].map(lambda parts: [i for ids in parts.values() for i in ids]).explode().dropna()
    # components (system prompt chunks, passages, ...) repeat about as often as in the trace
    assert 1 - len(set(blocks)) / len(blocks) == pytest.approx(1 - raw_ids.nunique() / len(raw_ids), abs=0.1)


@pytest.mark.parametrize("context", [16000, 32000])
def test_rag_long_context_pushes_prompts_to_the_target(context):
    requests = build("rag_long", requests=30, context=context).requests
    lengths = np.array([r.num_prompt_tokens for r in requests])
    assert lengths.min() >= 0.85 * context and lengths.max() <= context + 512  # one passage at most over


def test_long_chat_history_grows_in_shared_blocks(real_trace):
    raw = pd.read_json(real_trace("mooncake/conversation_trace.jsonl"), lines=True)
    requests = build("long_chat", requests=400, seed=2).requests
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    assert all(len(turns) >= 2 for turns in list(by_session.values())[:-1])  # only the last is cut short
    for turns in by_session.values():
        for before, after in zip(turns, turns[1:]):
            # the next prompt = this prompt + its answer + a new message, token for token
            assert after.prompt_ids[: before.num_prompt_tokens] == before.prompt_ids
            assert after.num_prompt_tokens > before.num_prompt_tokens + before.max_new_tokens
            full = before.num_prompt_tokens // before.block_tokens
            assert after.prefix_blocks[:full] == before.prefix_blocks[:full]
            assert after.think_time_s >= 0 and after.turn == before.turn + 1
    # every session starts with the same system block, as every Mooncake request does
    assert len({r.prompt_ids[:512] for r in requests}) == 1 == raw["hash_ids"].map(lambda ids: ids[0]).nunique()
    outputs = pd.Series([r.max_new_tokens for r in requests])
    assert outputs.median() == pytest.approx(raw["output_length"].median(), rel=0.15)


def test_offline_batch_defaults_and_ranges():
    fixed = build("offline_batch", requests=10).requests
    assert {(r.num_prompt_tokens, r.max_new_tokens, r.arrival_s) for r in fixed} == {(512, 256, 0.0)}
    ranged = build("offline_batch", requests=300, input_range=parse_length_range("128-1024"), output_tokens=32)
    lengths = [r.num_prompt_tokens for r in ranged.requests]
    assert min(lengths) >= 128 and max(lengths) <= 1024 and len(set(lengths)) > 100
    assert {r.max_new_tokens for r in ranged.requests} == {32}


def test_burst_is_shaped_like_azure_code(real_trace):
    raw = pd.read_csv(real_trace("azure_llm_2023/AzureLLMInferenceTrace_code.csv"))
    workload = build("burst", requests=2000)
    assert workload.arrival == "gamma"
    inputs = pd.Series([r.num_prompt_tokens for r in workload.requests])
    assert inputs.median() == pytest.approx(raw["ContextTokens"].median(), rel=0.1)
    gaps = np.diff([r.arrival_s for r in workload.requests])
    times = pd.to_datetime(raw["TIMESTAMP"])
    raw_rate = (len(raw) - 1) / (times.max() - times.min()).total_seconds()
    assert 1 / gaps.mean() == pytest.approx(raw_rate, rel=0.1)
    assert gaps.std() / gaps.mean() > 1.5  # burstier than Poisson (CV 1)


def test_scale_shrinks_lengths_and_keeps_arrivals():
    full = build("rag_long", requests=200, seed=4).requests
    small = build("rag_long", requests=200, seed=4, scale=0.25).requests
    assert [r.arrival_s for r in small] == [r.arrival_s for r in full]
    ratio = sum(r.num_prompt_tokens for r in small) / sum(r.num_prompt_tokens for r in full)
    assert ratio == pytest.approx(0.25, rel=0.05)


def test_requests_and_duration_bound_a_run():
    assert len(build("rag_long", requests=17, scale=0.1).requests) == 17
    timed = build("rag_long", duration_s=120.0, rate=2.0, scale=0.1).requests
    assert max(r.arrival_s for r in timed) < 120.0 and len(timed) > 50


def test_max_model_len_clips_and_says_so():
    workload = build("long_chat", ModelTarget(1000, 2048), requests=50, seed=1)
    assert all(r.num_prompt_tokens + r.max_new_tokens <= 2048 for r in workload.requests)
    assert any("clipped to max_model_len 2048" in note for note in workload.notes)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"name": "rag_short"}, "long_chat"),
        ({"name": "rag_long", "scale": 0.0}, "scale"),
        ({"name": "rag_long", "arrival": "sometimes"}, "poisson"),
        ({"name": "rag_long", "arrival": "trace"}, "trace:PATH"),
        ({"name": "long_chat", "context": 16000}, "rag_long"),
        ({"name": "offline_batch", "input_range": (900, 100)}, "lo <= hi"),
        ({"name": "burst", "requests": 0}, "requests"),
        ({"name": "burst", "seed": -1}, "seed"),
        ({"name": "agentic", "session_reuse": "infer"}, "trace:PATH"),
        ({"name": "trace:x.jsonl", "session_reuse": "always"}, "infer, none"),
        ({"name": "agentic", "turns": "sometimes"}, "dependent, independent"),
    ],
)
def test_bad_options_name_the_field(options, needle):
    with pytest.raises(WorkloadError, match=needle):
        WorkloadSpec(**options)


def test_length_only_trace_needs_an_arrival_process(real_trace):
    path = real_trace("sarathi_sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    with pytest.raises(WorkloadError, match="no arrival times"):
        build(f"trace:{path}", requests=5)
    offline = build(f"trace:{path}", requests=5, arrival="offline").requests
    raw = pd.read_csv(path).head(5)
    assert [r.num_prompt_tokens for r in offline] == raw["num_prefill_tokens"].tolist()


def test_workload_modules_keep_their_arrows():
    """No workloads module imports torch, engines, harness or reports (numpy only where used)."""
    modules = [
        "workloads.registry", "workloads.assemble", "workloads.synth", "workloads.arrivals", "workloads.shapes",
        "workloads.agentic", "workloads.sessions",
        "workloads.fit", "workloads.bench",
        "workloads.traces.formats", "workloads.traces.stats",
        "workloads.traces.csv_formats", "workloads.traces.jsonl_formats",
    ]
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print(*(m for m in ('torch', 'engines', 'harness', 'reports', 'pandas') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_agentic_calls_extend_the_previous_call_and_share_the_system_prompt():
    from workloads.agentic import AGENT_SYSTEM_TOKENS

    workload = build("agentic", requests=120, seed=3)
    assert workload.arrival == "closed" and workload.concurrency == 4
    sessions: dict[str, list] = {}
    for r in workload.requests:
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) > 5
    heads = set()
    for turns in sessions.values():
        heads.add(tuple(turns[0].prompt_ids[:AGENT_SYSTEM_TOKENS]))
        for previous, turn in zip(turns, turns[1:]):
            # the call = the previous call + its answer (max_new_tokens long) + the tool's output
            held = previous.num_prompt_tokens + previous.max_new_tokens
            assert turn.num_prompt_tokens > held
            assert tuple(turn.prompt_ids[: previous.num_prompt_tokens]) == tuple(previous.prompt_ids)
            assert turn.think_time_s >= 0.01
    assert len(heads) == 1  # one system prompt + tool definitions for every session
    repeated, total = repeated_prefix_tokens(workload.requests)
    assert repeated / total > 0.9
    outputs = [r.max_new_tokens for r in workload.requests]
    assert np.median(outputs) < 300 and max(r.num_prompt_tokens for r in workload.requests) > 20_000


def test_agentic_fits_a_short_context_and_says_so():
    workload = build("agentic", ModelTarget(vocab_size=500, max_model_len=2048, special_ids=(2,)), requests=60)
    assert all(r.num_prompt_tokens + r.max_new_tokens <= 2048 for r in workload.requests)
    assert not any("clipped" in n for n in workload.notes)  # sessions end before the context fills
    assert any("x0.03125 (max_model_len 2048 / 65,536-token agent context)" in n for n in workload.notes)
    assert repeated_prefix_tokens(workload.requests)[0] / repeated_prefix_tokens(workload.requests)[1] > 0.5


def test_agentic_on_the_bundled_model_reuses_most_of_its_prompts(tmp_path):
    """pwbench run --workload agentic: the bundled demo model, the default engine for it (full),
    tool times x0.01 to keep the test short."""
    from harness.run import RunArgs, execute

    spec = WorkloadSpec("agentic", requests=16, time_scale=0.01)
    folder, run = execute(RunArgs(workload=spec, engine="full", output=str(tmp_path / "run"), warmup=0,
                                  quality=False, telemetry_hz=1.0))
    assert run["status"] == "complete" and run["summary"]["completed"] == 16
    assert run["summary"]["engine"]["prefix_cache_hit_rate"] > 0.5
