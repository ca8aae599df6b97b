"""The generator constants in workloads/fitted.py come from the real traces.

Two kinds of check: `python -m workloads.fit` still reproduces every constant, and every
fitted constant is recomputed here from the raw files with pandas/numpy, without pwbench's
readers or its fitter (workloads/fit.py). The oracle follows each constant's definition as
its comment in fitted.py (or the fit.py docstring, for Mooncake's session inference) states
it; quantile tables are pandas' linear quantiles at fitted.QUANTILES.

Not recomputable, because they are choices rather than fits (no trace or paper defines them):
QUANTILES (the table's probability grid) and MAX_THINK_S (the 1 h cut between "thinking" and
"coming back later"). test_every_constant_has_an_oracle keeps this list honest.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from workloads import fitted
from workloads.fit import fit_all

NOT_FITTED = {"QUANTILES", "MAX_THINK_S"}  # design choices, see the module docstring
CHECKED_HERE = {  # constant -> the test below that recomputes it from the raw trace
    "CHAT_SHARED_BLOCKS": "test_chat_shared_blocks",
    "CHAT_OUTPUT_Q": "test_constants_match_pandas_on_the_raw_files",
    "CHAT_FIRST_INPUT_Q": "test_chat_sessions_from_prefix_chains",
    "CHAT_NEW_MESSAGE_Q": "test_chat_sessions_from_prefix_chains",
    "CHAT_THINK_Q": "test_chat_sessions_from_prefix_chains",
    "CHAT_TURNS_PMF": "test_chat_sessions_from_prefix_chains",
    "RAG_OUTPUT_Q": "test_constants_match_pandas_on_the_raw_files",
    "RAG_PASSAGES_PMF": "test_constants_match_pandas_on_the_raw_files",
    "RAG_TURNS_PMF": "test_constants_match_pandas_on_the_raw_files",
    "RAG_SYS_BLOCK_TOKENS": "test_rag_system_prompt",
    "RAG_SYS_VARIANTS": "test_rag_system_prompt",
    "RAG_SYS_POOL_PER_REQUEST": "test_rag_system_prompt",
    "RAG_SYS_POOL_ZIPF": "test_rag_system_prompt",
    "RAG_PASSAGE_LEN_Q": "test_rag_passages",
    "RAG_PASSAGE_POOL_PER_REF": "test_rag_passages",
    "RAG_PASSAGE_ZIPF": "test_rag_passages",
    "RAG_EMPTY_HISTORY_TOKENS": "test_rag_history_web_question_template",
    "RAG_WEB_PMF": "test_rag_history_web_question_template",
    "RAG_WEB_LEN_Q": "test_rag_history_web_question_template",
    "RAG_QUESTION_Q": "test_rag_history_web_question_template",
    "RAG_TEMPLATE_TOKENS": "test_rag_history_web_question_template",
    "RAG_THINK_Q": "test_rag_think_times",
    "BURST_INPUT_Q": "test_constants_match_pandas_on_the_raw_files",
    "BURST_OUTPUT_Q": "test_constants_match_pandas_on_the_raw_files",
    "BURST_RATE": "test_constants_match_pandas_on_the_raw_files",
    "BURST_BURSTINESS": "test_burst_burstiness",
}


def quantile_table(values, digits: int = 0) -> tuple:
    """Linear quantiles at fitted.QUANTILES, rounded to whole tokens (or `digits` places)."""
    qs = pd.Series(values, dtype="float64").quantile(list(fitted.QUANTILES))
    return tuple(int(round(q)) if digits == 0 else round(float(q), digits) for q in qs)


def counts_pmf(counts: pd.Series) -> dict[int, int]:
    """value_counts() -> {value: observations}, values ascending."""
    return {int(k): int(v) for k, v in sorted(counts.items())}


def zipf_slope(ref_counts: pd.Series, top: int = 1000) -> float:
    """Ordinary least squares of log(frequency) on log(rank) over the `top` most used ids,
    written out (cov / var) rather than via np.polyfit; returns -slope, 3 decimals."""
    freq = np.sort(ref_counts.to_numpy(dtype=float))[::-1][:top]
    x, y = np.log(np.arange(1, len(freq) + 1)), np.log(freq)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    return round(float(-slope), 3)


def jsonl(path) -> pd.DataFrame:
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


@pytest.fixture(scope="module")
def chat(real_trace) -> pd.DataFrame:
    raw = pd.read_json(real_trace("mooncake/conversation_trace.jsonl"), lines=True)
    return raw.sort_values("timestamp", kind="stable").reset_index(drop=True)  # arrival order, ties in file order


@pytest.fixture(scope="module")
def rag(real_trace):
    """The RAGPulse trace with every component exploded to (request, kind, id, token length)."""
    folder = real_trace("ragpulse")
    trace = jsonl(folder / "0_trace.jsonl")
    tables = {
        "sys_prompt": ("1_sys_prompt.jsonl", "sys_prompt_id"),
        "passages_ids": ("2_passages.jsonl", "passage_id"),
        "history": ("3_history.jsonl", "history_id"),
        "user_input": ("4_user_input.jsonl", "user_input_id"),
        "web_search": ("5_web_search.jsonl", "web_search_id"),
    }
    parts = []
    for key, (name, id_col) in tables.items():
        table = pd.read_json(folder / name, lines=True)
        assert table[id_col].is_unique, name  # one length per id, so a map is well defined
        lengths = table.set_index(id_col)["token_length"]
        ids = trace["hash_ids"].map(lambda h, key=key: h.get(key, [])).explode().dropna()
        frame = pd.DataFrame({"request": ids.index, "kind": key, "id": ids.astype("int64").to_numpy()})
        frame["position"] = frame.groupby("request").cumcount()
        frame["tokens"] = frame["id"].map(lengths)
        assert frame["tokens"].notna().all(), f"an id of {key} is not in {name}"
        parts.append(frame)
    return trace, pd.concat(parts, ignore_index=True)


def test_fit_reproduces_every_constant(real_trace):
    root = real_trace("mooncake").parent
    for source, constants in fit_all(root).items():
        for name, value in constants.items():
            assert getattr(fitted, name) == value, f"{name} (from {source}) is stale; rerun python -m workloads.fit"


def test_every_constant_has_an_oracle():
    """A constant added to fitted.py without a raw-trace check here fails this test."""
    names = {n for n in vars(fitted) if n.isupper()}
    assert names == NOT_FITTED | CHECKED_HERE.keys()
    assert set(CHECKED_HERE.values()) <= set(globals()), "CHECKED_HERE names a test that does not exist"


def test_constants_match_pandas_on_the_raw_files(real_trace, chat):
    rag = jsonl(real_trace("ragpulse/0_trace.jsonl"))
    assert fitted.RAG_OUTPUT_Q == quantile_table(rag["output_length"])
    passages = rag["hash_ids"].map(lambda parts: len(parts["passages_ids"])).value_counts()
    assert fitted.RAG_PASSAGES_PMF == counts_pmf(passages)
    assert fitted.RAG_TURNS_PMF == counts_pmf(rag["session_id"].value_counts().value_counts())

    assert fitted.CHAT_OUTPUT_Q == quantile_table(chat["output_length"])

    code = pd.read_csv(real_trace("azure_llm_2023/AzureLLMInferenceTrace_code.csv"))
    assert fitted.BURST_INPUT_Q == quantile_table(code["ContextTokens"])
    assert fitted.BURST_OUTPUT_Q == quantile_table(code["GeneratedTokens"])
    times = pd.to_datetime(code["TIMESTAMP"])
    assert fitted.BURST_RATE == round((len(code) - 1) / (times.max() - times.min()).total_seconds(), 3)


def test_chat_shared_blocks(chat):
    """The longest run of leading block ids that every request has in common."""
    shared = 0
    while chat["hash_ids"].map(lambda ids: ids[shared] if len(ids) > shared else None).nunique(dropna=False) == 1:
        shared += 1
    assert fitted.CHAT_SHARED_BLOCKS == shared == 1


def chat_parents(chat: pd.DataFrame) -> pd.Series:
    """fit.py's rule, re-derived with pandas: a request continues the latest earlier request
    it shares the longest run (>= 2) of leading blocks with.

    One row per (request, prefix length k) with an integer id per distinct prefix; within a
    prefix's group, shift(1) is the latest earlier request with that prefix; the parent is
    that request at the largest k >= 2 where one exists.
    """
    prefix_id: dict[tuple[int, int], int] = {}
    request, length, prefix = [], [], []
    for i, ids in enumerate(chat["hash_ids"]):
        key = -1
        for k, block in enumerate(ids, 1):
            key = prefix_id.setdefault((key, block), len(prefix_id))
            request.append(i)
            length.append(k)
            prefix.append(key)
    frame = pd.DataFrame({"request": request, "k": length, "prefix": prefix})
    frame["previous"] = frame.groupby("prefix")["request"].shift(1)
    hits = frame[(frame["k"] >= 2) & frame["previous"].notna()]
    parent = hits.sort_values(["request", "k"]).groupby("request")["previous"].last().astype("int64")
    return parent.reindex(range(len(chat)))  # NaN: the request starts a session


def test_chat_sessions_from_prefix_chains(chat):
    parent = chat_parents(chat)
    root = np.arange(len(chat))
    for i, p in parent.dropna().astype("int64").items():  # parents come earlier, so roots are known
        root[i] = root[p]
    turns = pd.Series(root).value_counts()

    assert fitted.CHAT_TURNS_PMF == counts_pmf(turns[turns >= 2].value_counts())
    assert sum(fitted.CHAT_TURNS_PMF.values()) == 2259  # "the 2,259 sessions with >= 2 turns"

    multi = sorted(turns[turns >= 2].index)
    assert fitted.CHAT_FIRST_INPUT_Q == quantile_table(chat.loc[multi, "input_length"])

    child = parent.dropna().astype("int64")
    before, after = chat.loc[child.to_numpy()].reset_index(drop=True), chat.loc[child.index].reset_index(drop=True)
    new = after["input_length"] - before["input_length"] - before["output_length"]
    assert fitted.CHAT_NEW_MESSAGE_Q == quantile_table(new[new > 0])
    assert (new <= 0).mean() == pytest.approx(0.19, abs=0.005)  # "19% of turns trim history"

    think_s = (after["timestamp"] - before["timestamp"]) / 1000.0
    assert fitted.CHAT_THINK_Q == quantile_table(think_s, digits=1)


def test_rag_system_prompt(rag):
    trace, parts = rag
    sys_parts = parts[parts["kind"] == "sys_prompt"].pivot(index="request", columns="position", values=["id", "tokens"])
    assert sys_parts.shape == (len(trace), 6)  # every system prompt has exactly 3 chunks

    lead = pd.concat([sys_parts[("tokens", 0)], sys_parts[("tokens", 1)]])
    assert fitted.RAG_SYS_BLOCK_TOKENS == int(lead.mode()[0]) == 512
    assert (lead == 512).all()  # "always 512 tokens"

    variants = []
    for _first, group in sys_parts.groupby(("id", 0), sort=False):
        tail_tokens = int(group[("tokens", 2)].value_counts().idxmax())
        variants.append((len(group), tail_tokens, group[("id", 2)].nunique() == 1))
    assert fitted.RAG_SYS_VARIANTS == tuple(sorted(variants, key=lambda v: -v[0]))

    template = sys_parts[("id", 1)]
    assert fitted.RAG_SYS_POOL_PER_REQUEST == round(template.nunique() / len(trace), 4)
    assert fitted.RAG_SYS_POOL_ZIPF == zipf_slope(template.value_counts())


def test_rag_passages(rag):
    trace, parts = rag
    passages = parts[parts["kind"] == "passages_ids"]
    distinct = passages.drop_duplicates("id")
    assert fitted.RAG_PASSAGE_LEN_Q == quantile_table(distinct["tokens"])  # each passage once
    assert fitted.RAG_PASSAGE_POOL_PER_REF == round(len(distinct) / len(passages), 4)
    assert fitted.RAG_PASSAGE_ZIPF == zipf_slope(passages["id"].value_counts())


def test_rag_history_web_question_template(rag):
    trace, parts = rag
    history = parts[parts["kind"] == "history"].groupby("request")
    ids = history["id"].agg(tuple).reindex(range(len(trace)), fill_value=())
    most_common = ids.value_counts().idxmax()
    tokens = history["tokens"].sum().reindex(range(len(trace)), fill_value=0)
    assert fitted.RAG_EMPTY_HISTORY_TOKENS == int(tokens[ids == most_common].iloc[0])

    web = parts[parts["kind"] == "web_search"]
    assert fitted.RAG_WEB_PMF == counts_pmf(web.groupby("request").size().reindex(range(len(trace)),
                                                                                  fill_value=0).value_counts())
    assert fitted.RAG_WEB_LEN_Q == quantile_table(web["tokens"])  # every reference, not distinct ids
    assert fitted.RAG_QUESTION_Q == quantile_table(parts.loc[parts["kind"] == "user_input", "tokens"])

    covered = parts.groupby("request")["tokens"].sum().reindex(range(len(trace)), fill_value=0)
    glue = trace["input_length"] - covered
    assert fitted.RAG_TEMPLATE_TOKENS == (int(glue.min()), int(glue.max()))


def test_rag_think_times(rag):
    trace, _ = rag
    frame = pd.DataFrame({"session": trace["session_id"], "t": trace["timestamp"].astype(float)})
    frame = frame.sort_values(["session", "t"])
    gaps = frame.groupby("session")["t"].diff().dropna()
    assert fitted.RAG_THINK_Q == quantile_table(gaps[gaps <= fitted.MAX_THINK_S], digits=1)


def test_burst_burstiness(real_trace):
    """1 / gamma shape of the positive gaps between arrivals. fit.py uses Minka's closed-form
    estimate (T. Minka, "Estimating a Gamma distribution", 2002), which the paper puts within
    1.5% of the maximum-likelihood shape: recompute that estimate exactly, and check it against
    scipy's numerical maximum likelihood within that bound."""
    code = pd.read_csv(real_trace("azure_llm_2023/AzureLLMInferenceTrace_code.csv"))
    seconds = (pd.to_datetime(code["TIMESTAMP"]) - pd.Timestamp("2023-11-16")).dt.total_seconds()
    gaps = np.diff(np.sort(seconds.to_numpy()))
    gaps = gaps[gaps > 0]
    s = math.log(gaps.mean()) - np.log(gaps).mean()
    minka = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    assert fitted.BURST_BURSTINESS == round(1 / minka, 3)
    mle_shape, _, _ = stats.gamma.fit(gaps, floc=0)
    assert fitted.BURST_BURSTINESS == pytest.approx(1 / mle_shape, rel=0.015)
