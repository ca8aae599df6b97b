"""The `agentic` workload: coding-agent sessions, each one agent loop of model calls.

Every call's prompt is the previous call's prompt + its answer (the tool call) + the tool's
output, after a system prompt + tool definitions shared by every session, so prefix reuse is
there by construction. Constants and the public facts they rest on: docs/workloads.md "agentic".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from workloads.arrivals import STREAM_SHAPES, rng
from workloads.assemble import Shape
from workloads.fitted import QUANTILES, sample_quantiles
from workloads.synth import RequestSkeleton

# System prompt + tool definitions sent on every call (Claude Code: ~19,000 tokens; hpfreilabs.com
# "Anatomy of a Claude Code session").
AGENT_SYSTEM_TOKENS = 19_000
# Model calls per session (one user request and its tool-triggered steps), at fitted.QUANTILES:
# 1 + TraceLab's tool-initiated steps per request (p25 0, p50 1, p90 20, p99 86, mean 7.8); the
# points between TraceLab's stated percentiles are interpolated.
AGENT_STEPS_Q = (1, 1, 1, 1, 1, 1, 2, 2, 3, 5, 9, 21, 35, 87, 150)
# Tokens a step appends (the tool's output; the user's message on the first step): heavy-tailed,
# most small and the mass in rare large ones (TraceLab); mean 1,652 (linear between the points),
# the Claude Code SWE-bench trace's ~1.7k new tokens a call (92 calls, ~2M input tokens, 92% reuse).
AGENT_APPEND_Q = (8, 15, 30, 50, 90, 140, 200, 290, 420, 620, 1000, 2400, 6000, 24000, 64000)
# Tokens a step generates (the tool call, or the final answer): short, right-skewed, mean 362;
# TraceLab's mean is 523 (186.9M output tokens over 357,161 steps, Codex's reasoning included).
AGENT_OUTPUT_Q = (4, 10, 20, 30, 50, 75, 105, 140, 190, 260, 380, 700, 1300, 3500, 8000)
# Seconds between an answer and the next call (the tool running): TraceLab's per-call tool latency
# has medians of 125 ms (Claude Code) and 626 ms (Codex) and its time mass in 1 s-10 min; mean 4.6 s.
AGENT_TOOL_S_Q = (0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 2.0, 6.0, 15.0, 60.0, 300.0)
# Lengths are sized for this working context (the system prompt plus a loop that grows to tens of
# thousands of tokens); on a model with a shorter max_model_len every length is multiplied by
# max_model_len / AGENT_FIT_TOKENS, so the bundled 2k-token demo model gets the same shape.
AGENT_FIT_TOKENS = 65_536
AGENT_WINDOW = 200_000  # Claude's context window: a session ends (the agent compacts) before it
SYSTEM_BLOCK = 0  # block id of the shared system prompt + tool definitions
FIRST_SESSION_BLOCK = 1


def agentic_shape(spec, target=None) -> Shape:
    fit = min(1.0, target.max_model_len / AGENT_FIT_TOKENS) if target is not None else 1.0
    window = min(AGENT_WINDOW, target.max_model_len) if target is not None else AGENT_WINDOW
    notes = []
    if fit < 1.0:
        notes.append(f"agentic: every length x{fit:.4g} (max_model_len {target.max_model_len} / "
                     f"{AGENT_FIT_TOKENS:,}-token agent context), then x{spec.scale:g} (--scale)")
    notes.append(f"agentic: a session ends before its context passes {window:,} tokens (the agent compacts)")
    return Shape(lambda hint: _sessions(spec, spec.scale * fit, window), steps_mean(), "closed", notes=tuple(notes))


def _sessions(spec, scale: float, window: int) -> Iterator[list[RequestSkeleton]]:
    """Session k: steps j = 0.. with prompt_j = system + sum of (append_i, output_i) for i < j +
    append_j, as chains of blocks (system, then per step its append and its answer) whose ids
    are kept, so the synthesized prompt of step j+1 begins with that of step j and its answer."""
    import numpy as np

    g = rng(spec.seed, STREAM_SHAPES)
    ids = itertools.count(FIRST_SESSION_BLOCK)
    system = max(1, round(AGENT_SYSTEM_TOKENS * scale))

    def draw(table: tuple[float, ...], minimum: int = 1) -> int:
        return int(sample_quantiles(g, table, 1, scale, minimum)[0])

    for number in itertools.count():
        steps = int(sample_quantiles(g, AGENT_STEPS_Q, 1, 1.0)[0])
        chain = [(SYSTEM_BLOCK, system, "sys_prompt")]
        session = []
        for step in range(steps):
            chain.append((next(ids), draw(AGENT_APPEND_Q), "user" if step == 0 else "tool_output"))
            output = draw(AGENT_OUTPUT_Q)
            prompt = sum(n for _, n, _ in chain)
            if prompt + output > window:
                if step == 0:  # even the first call does not fit: keep the head (clipped later)
                    chain[-1] = (chain[-1][0], max(1, window // 2 - system), chain[-1][2])
                else:
                    break
            think = float(np.interp(g.random(), QUANTILES, AGENT_TOOL_S_Q)) if step else 0.0  # sub-second
            session.append(RequestSkeleton(
                index=-1, input_tokens=sum(n for _, n, _ in chain), output_tokens=output,
                session_id=f"agentic-s{number}", turn=step, think_time_s=think,
                think_after_s=think if step else None,
                blocks=tuple(b for b, _, _ in chain), block_lengths=tuple(n for _, n, _ in chain),
                block_kinds=tuple(k for _, _, k in chain),
            ))
            chain.append((next(ids), output, "answer"))
        yield session


def steps_mean() -> float:
    """Mean model calls per session of AGENT_STEPS_Q (linear between the quantiles)."""
    pairs = list(zip(QUANTILES, AGENT_STEPS_Q))
    return math.fsum((q1 - q0) * (v0 + v1) / 2 for (q0, v0), (q1, v1) in zip(pairs, pairs[1:]))
