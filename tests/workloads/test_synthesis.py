"""Prompt synthesis: prefix sharing as in the trace, seeds, vocabulary limits.

Oracles: the raw trace files read with json (hash ids, side-table lengths), and comparisons
of one build against another (same seed, other seed, another interpreter).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from workloads.assemble import make_plan
from workloads.registry import ModelTarget, WorkloadSpec, build_workload, workload_shape
from workloads.synth import HashBlockSynthesizer

BIG = ModelTarget(vocab_size=32000, max_model_len=10**6, special_ids=(0, 1, 2))
BLOCK = 512


@pytest.mark.slow  # ~10 s; kept under the README's ~12 min; CI's slow step runs it
def test_mooncake_replay_repeats_prefix_tokens_like_the_raw_hash_ids(real_trace):
    """Share of prompt tokens inside 512-token blocks whose tokens appeared before, in arrival order."""
    path = real_trace("mooncake/conversation_trace.jsonl")
    seen_ids: set[int] = set()
    raw_total = raw_repeated = 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        raw_total += row["input_length"]
        for j, block_id in enumerate(row["hash_ids"]):
            if block_id in seen_ids:
                raw_repeated += min(BLOCK, row["input_length"] - BLOCK * j)
            seen_ids.add(block_id)

    spec = WorkloadSpec(f"trace:{path}")
    plan = make_plan(spec, BIG, workload_shape(spec))
    synthesizer = HashBlockSynthesizer(spec.seed, BIG.vocab_size, BIG.special_ids)
    seen_blocks: set[bytes] = set()
    total = repeated = 0
    for skeleton in plan.skeletons:  # the whole trace's prompts (145M tokens) one at a time
        tokens = synthesizer.token_ids(skeleton).astype(np.int32)
        total += len(tokens)
        for start in range(0, len(tokens), BLOCK):
            chunk = tokens[start : start + BLOCK]
            digest = hashlib.blake2b(chunk.tobytes(), digest_size=16).digest()
            repeated += len(chunk) if digest in seen_blocks else 0
            seen_blocks.add(digest)
    assert (total, repeated) == (raw_total, raw_repeated)
    assert 0.3 < repeated / total < 0.45  # sanity: SOURCES.md reports about a third of blocks repeat

    head = build_workload(WorkloadSpec(f"trace:{path}", requests=20), BIG).requests
    assert [r.prompt_ids for r in head] == [tuple(synthesizer.token_ids(s).tolist()) for s in plan.skeletons[:20]]


def test_ragpulse_components_with_one_id_have_one_content(real_trace):
    """Every component id maps to one token sequence, of the side table's length, wherever it appears."""
    folder = real_trace("ragpulse")
    lengths = {}
    for table in sorted(folder.glob("[1-5]_*.jsonl")):
        for line in table.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                lengths[next(v for k, v in row.items() if k.endswith("_id"))] = row["token_length"]
    requests = build_workload(WorkloadSpec(f"trace:{folder}", requests=400), BIG).requests
    content: dict[int, tuple[int, ...]] = {}
    reused = 0
    for request in requests:
        start = 0
        for block_id, length in zip(request.prefix_blocks, request.block_lengths):
            assert length == lengths[block_id]
            tokens = request.prompt_ids[start : start + length]
            reused += block_id in content
            assert content.setdefault(block_id, tokens) == tokens
            start += length
        assert start <= request.num_prompt_tokens
    assert reused > 1000  # passages and system prompts really are shared in the first 400 requests


def _build(name: str, seed: int, **options):
    return build_workload(WorkloadSpec(name, seed=seed, **options), ModelTarget(32000, 16384, (0, 1, 2)))


@pytest.mark.parametrize(
    "name, options",
    [("rag_long", {}), ("long_chat", {}), ("agentic", {}), ("burst", {}), ("offline_batch", {"input_range": (16, 64)})],
)
def test_same_seed_gives_byte_identical_requests(name, options):
    a = _build(name, 7, requests=40, scale=0.25, **options)
    b = _build(name, 7, requests=40, scale=0.25, **options)
    assert pickle.dumps(a.requests) == pickle.dumps(b.requests)
    c = _build(name, 8, requests=40, scale=0.25, **options)
    assert [r.prompt_ids for r in c.requests] != [r.prompt_ids for r in a.requests]


@pytest.mark.parametrize("relative", ["mooncake/conversation_trace.jsonl", "ragpulse"])
def test_other_seed_changes_content_not_lengths_or_arrivals(real_trace, relative):
    path = real_trace(relative)
    a = _build(f"trace:{path}", 0, requests=150).requests
    b = _build(f"trace:{path}", 1, requests=150).requests

    def shape(r):
        return (r.num_prompt_tokens, r.max_new_tokens, r.arrival_s, r.session_id, r.turn, r.prefix_blocks)

    assert [shape(r) for r in a] == [shape(r) for r in b]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra.prompt_ids, rb.prompt_ids))
    assert same / sum(r.num_prompt_tokens for r in a) < 0.01  # about 1/vocab by chance


def test_same_seed_is_identical_in_another_interpreter():
    """No dependence on Python's per-process string hashing or dict order."""
    code = (
        "import hashlib, pickle\n"
        "from workloads.registry import ModelTarget, WorkloadSpec, build_workload\n"
        "w = build_workload(WorkloadSpec('rag_long', seed=3, requests=30, scale=0.2), ModelTarget(5000, 8192, (0,)))\n"
        "print(hashlib.sha256(pickle.dumps(w.requests)).hexdigest())"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        digests.add(proc.stdout.strip())
    assert len(digests) == 1


def test_tokens_stay_in_the_vocabulary_and_avoid_special_ids():
    special = (0, 1, 2, 7, 99)
    requests = build_workload(WorkloadSpec("rag_long", requests=30, scale=0.3),
                              ModelTarget(100, 8192, special)).requests
    tokens = np.concatenate([np.asarray(r.prompt_ids) for r in requests])
    assert tokens.min() >= 0 and tokens.max() < 100
    assert not np.isin(tokens, special).any()
    assert len(np.unique(tokens)) == 100 - len(special)  # and every other id is used
