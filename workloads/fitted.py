"""Distribution constants that shape the generated workloads, fitted from the real traces.

Produced by `python -m workloads.fit` (a test checks they still match; provenance of the
traces in ../shared/traces/SOURCES.md). Lengths and times are quantile tables at QUANTILES,
sampled by inverse CDF (`sample_quantiles`); counts are pmfs {value: observations}.
"""

from __future__ import annotations

from functools import lru_cache

QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
MAX_THINK_S = 3600.0  # a longer gap inside a session is a user coming back later, not thinking

# Fitted from mooncake/conversation_trace.jsonl (Mooncake FAST'25, Kimi). Sessions are inferred
# from prefix chains (workloads/fit.py); long_chat uses the 2,259 sessions with >= 2 turns.
CHAT_SHARED_BLOCKS = 1  # every request starts with the same 512-token block (system prompt)
CHAT_FIRST_INPUT_Q = (892, 1033, 1133, 1300, 2018, 3876, 5207, 6893, 9223, 12496, 17477, 25379, 33610, 72759, 122891)
# Next prompt - previous prompt - previous answer, where positive (19% of turns trim history).
CHAT_NEW_MESSAGE_Q = (1, 4, 6, 8, 11, 16, 25, 46, 134, 462, 2209, 5048, 7897, 19027, 91467)
CHAT_OUTPUT_Q = (1, 3, 10, 24, 100, 213, 291, 350, 399, 447, 504, 597, 698, 1119, 2000)
# Seconds from one turn's arrival to the next (includes the previous answer's generation).
CHAT_THINK_Q = (0.0, 12.0, 30.0, 42.0, 60.0, 75.0, 96.0, 123.0, 162.0, 222.0, 318.0, 483.0, 615.4, 1476.9, 3030.0)
CHAT_TURNS_PMF = {2: 1311, 3: 464, 4: 200, 5: 117, 6: 55, 7: 27, 8: 26, 9: 10, 10: 16, 11: 5, 12: 2, 13: 4, 14: 2,
                  15: 5, 16: 4, 17: 4, 18: 1, 19: 1, 21: 1, 22: 1, 25: 1, 27: 1, 43: 1}

# Fitted from ragpulse/0_trace.jsonl + side tables (RAGPulse, a university policy-Q&A RAG service).
RAG_SYS_BLOCK_TOKENS = 512  # the system prompt's first two chunks are always 512 tokens
# System prompt = a shared first chunk (one of three variants) + a template chunk from a pool +
# a tail; per variant: (requests, tail tokens, tail shared by all requests of the variant).
RAG_SYS_VARIANTS = ((5448, 437, False), (1402, 4, True), (256, 447, False))
RAG_SYS_POOL_PER_REQUEST = 0.1991  # distinct template chunks per request
RAG_SYS_POOL_ZIPF = 0.393  # popularity exponent of template chunks (log-log rank fit, top 1000)
RAG_PASSAGES_PMF = {0: 1465, 1: 63, 2: 28, 3: 37, 4: 20, 5: 26, 6: 5454, 7: 13}
RAG_PASSAGE_LEN_Q = (3, 48, 118, 141, 176, 207, 239, 266, 293, 311, 326, 345, 363, 404, 512)
RAG_PASSAGE_POOL_PER_REF = 0.0973  # distinct passages per passage reference
RAG_PASSAGE_ZIPF = 0.803  # passage popularity exponent (log-log rank fit, top 1000)
RAG_EMPTY_HISTORY_TOKENS = 11  # the history placeholder of a session's first turn
RAG_WEB_PMF = {0: 6850, 1: 30, 2: 82, 3: 111, 4: 31, 5: 2}
RAG_WEB_LEN_Q = (3, 23, 79, 133, 243, 376, 512, 512, 512, 512, 512, 512, 512, 512, 512)
RAG_QUESTION_Q = (1, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 12, 16, 28, 178)
RAG_TEMPLATE_TOKENS = (6, 12)  # input_length minus all components: chat-template glue
RAG_OUTPUT_Q = (7, 36, 66, 83, 113, 151, 191, 234, 284, 346, 436, 563, 670, 891, 2183)
RAG_TURNS_PMF = {1: 2347, 2: 960, 3: 376, 4: 151, 5: 62, 6: 28, 7: 18, 8: 15, 9: 9, 10: 11, 11: 3, 12: 2, 13: 2, 14: 2,
                 15: 1, 19: 1, 22: 1, 25: 1}
RAG_THINK_Q = (0.0, 6.0, 11.0, 14.0, 20.0, 25.0, 31.0, 39.0, 50.0, 67.0, 100.0, 203.7, 496.3, 1874.0, 3527.0)

# Fitted from azure_llm_2023/AzureLLMInferenceTrace_code.csv (Azure 2023 code completion, the
# burstiest trace here): gamma burstiness = 1 / maximum-likelihood shape of the gaps.
BURST_INPUT_Q = (3, 17, 75, 147, 386, 770, 1075, 1469, 1909, 2433, 3192, 5188, 7303, 7436, 7437)
BURST_OUTPUT_Q = (6, 6, 6, 7, 8, 9, 11, 13, 16, 20, 29, 55, 90, 251, 1899)
BURST_RATE = 2.566
BURST_BURSTINESS = 4.374


def sample_quantiles(rng, table: tuple[float, ...], size: int, scale: float = 1.0, minimum: int = 1):
    """`size` integer draws from a quantile table, times `scale`, at least `minimum`."""
    import numpy as np

    values = np.interp(rng.random(size), QUANTILES, table) * scale
    return np.maximum(minimum, np.rint(values)).astype(np.int64)


def sample_pmf(rng, pmf: dict[int, int], size: int):
    """`size` draws of the pmf's values, weighted by their counts: the same numbers (and the same
    use of the random stream) as rng.choice(values, size, p=counts / counts.sum())."""
    values, cdf = _pmf_table(tuple(pmf.items()))
    return values[draw_index(rng, cdf, size)]


@lru_cache(maxsize=64)
def _pmf_table(items: tuple[tuple[int, int], ...]):
    import numpy as np

    values = np.fromiter((k for k, _ in items), dtype=np.int64)
    weights = np.fromiter((n for _, n in items), dtype=np.float64)
    return values, cumulative(weights / weights.sum())


def cumulative(p):
    """The normalised CDF of probabilities p, as numpy's Generator.choice computes it."""
    import numpy as np

    cdf = np.asarray(p, dtype=np.float64).cumsum()
    cdf /= cdf[-1]
    return cdf


def draw_index(rng, cdf, size: int | None = None):
    """Indices drawn with probabilities given by `cdf` (from cumulative): one uniform per draw,
    what rng.choice(len(cdf), size, p=p) does (numpy 2.x), without re-checking p on every call."""
    return cdf.searchsorted(rng.random(size), side="right")


def pmf_mean(pmf: dict[int, int]) -> float:
    return sum(k * n for k, n in pmf.items()) / sum(pmf.values())
