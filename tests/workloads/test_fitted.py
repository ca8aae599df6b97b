"""The generator constants in workloads/fitted.py come from the real traces.

Two checks: `python -m workloads.fit` still reproduces every constant, and a few of them are
recomputed here from the raw files with pandas, without pwbench's readers.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from workloads import fitted
from workloads.fit import fit_all


def quantile_table(values: pd.Series) -> tuple[int, ...]:
    return tuple(int(round(q)) for q in np.quantile(values.to_numpy(dtype=float), fitted.QUANTILES))


def test_fit_reproduces_every_constant(real_trace):
    root = real_trace("mooncake").parent
    for source, constants in fit_all(root).items():
        for name, value in constants.items():
            assert getattr(fitted, name) == value, f"{name} (from {source}) is stale; rerun python -m workloads.fit"


def test_constants_match_pandas_on_the_raw_files(real_trace):
    rag = pd.DataFrame(
        [json.loads(line) for line in real_trace("ragpulse/0_trace.jsonl").read_text().splitlines() if line.strip()]
    )
    assert fitted.RAG_OUTPUT_Q == quantile_table(rag["output_length"])
    passages = rag["hash_ids"].map(lambda parts: len(parts["passages_ids"])).value_counts()
    assert fitted.RAG_PASSAGES_PMF == {int(k): int(v) for k, v in sorted(passages.items())}
    assert fitted.RAG_TURNS_PMF == {int(k): int(v) for k, v in sorted(rag["session_id"].value_counts().value_counts().items())}

    chat = pd.read_json(real_trace("mooncake/conversation_trace.jsonl"), lines=True)
    assert fitted.CHAT_OUTPUT_Q == quantile_table(chat["output_length"])
    assert fitted.CHAT_SHARED_BLOCKS == 1 and chat["hash_ids"].map(lambda ids: ids[0]).nunique() == 1

    code = pd.read_csv(real_trace("azure_llm_2023/AzureLLMInferenceTrace_code.csv"))
    assert fitted.BURST_INPUT_Q == quantile_table(code["ContextTokens"])
    assert fitted.BURST_OUTPUT_Q == quantile_table(code["GeneratedTokens"])
    times = pd.to_datetime(code["TIMESTAMP"])
    assert fitted.BURST_RATE == round((len(code) - 1) / (times.max() - times.min()).total_seconds(), 3)
