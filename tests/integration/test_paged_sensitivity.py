"""The offline sensitivity table (engines/pagedweight/sensitivity.py) on the bundled demo model.

Calibration mixes every task the demo model serves (RAG recall, chat recall, closed-book
questions, from workloads.demo.tasks, encoded as training does), since engines cannot build
them. Oracles: the definition of the table (every expert and width, 0 at 16 bits), the
monotonicity of RTN error in bits, the cache file's identity (same key -> same file and
values, any changed option -> a new file), and the layer mean for experts with no rows.
"""

from __future__ import annotations

import json
import random
import time

import pytest
from tiny_models import CPU32

from engines.base import EngineError
from engines.common.demo import DEMO_MODEL_DIR
from engines.moe import MoEEngine, MoEEngineConfig
from engines.pagedweight.sensitivity import (
    calibration_set,
    load_or_measure,
    load_or_measure_engine,
    measure,
)

pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").is_file(),
                                reason="engines/demo_model is not built (pwbench demo train)")

BITS = (16, 8, 4, 3, 2)
REPS = ("bitplanes", "requantize")


def task_prompts(seed: int = 0, per_task: int = 6) -> list[list[int]]:
    """RAG recall and chat recall contexts with their question and answer, and closed-book
    question/answer runs, interleaved so no task dominates any stretch of the batch."""
    from workloads.demo.language import BOS_ID, demo_language
    from workloads.demo.tasks import chat_recall, closed_book, rag_recall

    lang, rng = demo_language(), random.Random(seed)

    def encode(sample) -> list[int]:
        ids = [BOS_ID] + lang.encode(sample.context)
        for question, answer in sample.qa:
            ids += lang.encode(question) + lang.encode(answer)
        return ids

    out = []
    for _ in range(per_task):
        out += [encode(rag_recall(rng, 16, 256)), encode(chat_recall(rng, 12, 256)),
                encode(closed_book(rng, 8)), encode(closed_book(rng, 8))]
    return out


@pytest.fixture(scope="module")
def engine():
    eng = MoEEngine(MoEEngineConfig(**CPU32, model=str(DEMO_MODEL_DIR)))
    with eng:
        yield eng


@pytest.fixture(scope="module")
def prompts():
    return task_prompts()


@pytest.mark.parametrize("rep", REPS)
def test_every_expert_and_width_decreasing_in_bits(engine, prompts, tmp_path, rep):
    table = load_or_measure_engine(engine, rep, BITS, 32, prompts=prompts, cache_dir=tmp_path)
    mc = engine.checkpoint.config
    assert set(table) == {(i, e) for i in range(mc.num_layers) for e in range(mc.num_experts)}
    for key, row in table.items():
        assert set(row) == set(BITS) and row[16] == 0.0
        assert 0 < row[8] < row[4] < row[3] < row[2], (key, row)
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    # The task mix reaches every expert: nothing filled with a layer mean, rows capped at 512.
    assert doc["filled"] == [] and all(0 < n <= 512 for n in doc["rows"].values())
    assert doc["calibration"]["source"] == "given" and doc["tokens"] == sum(map(len, prompts))


def test_report_calibrated_errors(engine, prompts, tmp_path):
    tables = {rep: load_or_measure_engine(engine, rep, BITS, 32, prompts=prompts, cache_dir=tmp_path) for rep in REPS}
    print("\nmean sensitivity on the demo model's calibration rows (RAG + chat + closed book), group 32")
    print("bits  requantize  bitplanes  bitplanes/requantize")
    for b in (8, 4, 3, 2):
        r, p = (sum(row[b] for row in tables[rep].values()) / len(tables[rep]) for rep in ("requantize", "bitplanes"))
        print(f"{b:>4}  {r:10.3e}  {p:9.3e}  {p / r:6.2f}")
    # Same 8-bit RTN weights in both representations: the same error.
    assert all(tables["bitplanes"][k][8] == tables["requantize"][k][8] for k in tables["bitplanes"])


def test_second_call_reads_the_cache(engine, prompts, tmp_path):
    t0 = time.perf_counter()
    first = load_or_measure_engine(engine, "bitplanes", BITS, 32, prompts=prompts, cache_dir=tmp_path)
    measured_s = time.perf_counter() - t0
    files = list(tmp_path.glob("*.json"))
    stamp = files[0].stat().st_mtime_ns
    t0 = time.perf_counter()
    second = load_or_measure_engine(engine, "bitplanes", BITS, 32, prompts=prompts, cache_dir=tmp_path)
    loaded_s = time.perf_counter() - t0
    assert second == first
    assert list(tmp_path.glob("*.json")) == files and files[0].stat().st_mtime_ns == stamp  # not rewritten
    assert loaded_s < measured_s / 5, (loaded_s, measured_s)
    # The engine's own call (checkpoint, dense experts, weights) reads the same entry.
    dense = {i: engine.experts.weights(i) for i in engine.experts.layers()}
    assert load_or_measure(engine.checkpoint, dense, engine.weights, "bitplanes", BITS, 32, prompts=prompts,
                           cache_dir=tmp_path) == first
    assert list(tmp_path.glob("*.json")) == files


def test_changed_options_make_new_entries(engine, prompts, tmp_path):
    base = {"prompts": prompts, "cache_dir": tmp_path}
    runs = [
        ("bitplanes", BITS, 32, base),
        ("requantize", BITS, 32, base),
        ("bitplanes", BITS, 64, base),
        ("bitplanes", (16, 4, 2), 32, base),
        ("bitplanes", BITS, 32, {**base, "max_rows": 64}),
        ("bitplanes", BITS, 32, {**base, "prompts": task_prompts(seed=1)}),
    ]
    tables = []
    for i, (rep, bits, group, opts) in enumerate(runs, 1):
        tables.append(load_or_measure_engine(engine, rep, bits, group, **opts))
        assert len(list(tmp_path.glob("*.json"))) == i, runs[i - 1][:3]
    assert tables[2] != tables[0] and tables[4] != tables[0] and tables[5] != tables[0]
    assert set(next(iter(tables[3].values()))) == {16, 4, 2}


def test_demo_model_refuses_random_token_calibration(engine, tmp_path):
    with pytest.raises(EngineError, match="closed-book"):
        load_or_measure_engine(engine, "bitplanes", BITS, 32, prompts=24, cache_dir=tmp_path)


def test_other_models_use_random_tokens_and_unrouted_experts_get_the_layer_mean(checkpoints, tmp_path):
    eng = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("mixtral"))))
    with eng:
        table = load_or_measure_engine(eng, "requantize", BITS, 32, prompts=4, prompt_len=64, cache_dir=tmp_path)
        mc = eng.checkpoint.config
        assert set(table) == {(i, e) for i in range(mc.num_layers) for e in range(mc.num_experts)}
        (path,) = tmp_path.glob("*.json")
        assert json.loads(path.read_text())["calibration"] == {"source": "random tokens", "samples": 4,
                                                               "length": 64, "seed": 0}
        # One token reaches top_k = 2 of 6 experts per layer; the other 4 get the layer's mean.
        dense = {i: eng.experts.weights(i) for i in eng.experts.layers()}
        m = measure(mc, dense, eng.weights, "bitplanes", BITS, 32, calibration_set(eng.checkpoint, [[5]]))
    assert len(m.filled) == mc.num_layers * (mc.num_experts - mc.top_k)
    for i, e in m.filled:
        seen = [m.table[(i, f)] for f in range(mc.num_experts) if (i, f) not in m.filled]
        assert m.table[(i, e)] == pytest.approx({b: sum(r[b] for r in seen) / len(seen) for b in BITS})
