"""max_model_len clipping (workloads/assemble.py, README "Workloads and traces"), on hand-computed
cases: a request whose prompt + output exceeds the limit gets its output cut to at most
max_model_len // 2 and its prompt to its first max_model_len - output tokens (shared leading
blocks survive); one exactly at the limit is left alone; the notes count the clipped ones.

The expected numbers below are worked out by hand from that rule, for max_model_len 1000
(half 500) unless a case says otherwise.
"""

from __future__ import annotations

import json

import pytest

from workloads.assemble import clip
from workloads.registry import ModelTarget, WorkloadSpec, build_workload
from workloads.synth import RequestSkeleton

LIMIT = 1000

# (input, output, hash_ids) -> (prompt kept, output kept, blocks kept); 512-token blocks.
CASES = [
    ((700, 300, [1, 2]), (700, 300, (1, 2))),  # exactly at the limit: untouched
    ((999, 1, [1, 2]), (999, 1, (1, 2))),  # exactly at the limit, the other way round
    ((701, 300, [1, 2]), (700, 300, (1, 2))),  # one over: the prompt loses its last token
    ((900, 300, [1, 2]), (700, 300, (1, 2))),  # together too long, each fits alone: prompt cut
    ((1500, 100, [1, 2, 3]), (900, 100, (1, 2))),  # prompt alone too long: block 3 (from 1024) goes
    ((1500, 800, [1, 2, 3]), (500, 500, (1,))),  # both too long: output to 500, prompt to 500
    ((200, 900, [1]), (200, 500, (1,))),  # output alone too long: the prompt fits and stays
    ((1, 5000, [1]), (1, 500, (1,))),  # a one-token prompt keeps its token
    ((1024, 488, [1, 2]), (512, 488, (1,))),  # cut exactly at a block boundary: block 2 is gone
]


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """The CASES as a Mooncake trace, built for max_model_len LIMIT and for a limit that clips nothing."""
    path = tmp_path_factory.mktemp("clip") / "trace.jsonl"
    rows = [{"timestamp": 10 * i, "input_length": i_, "output_length": o, "hash_ids": ids}
            for i, ((i_, o, ids), _) in enumerate(CASES)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = WorkloadSpec(f"trace:{path}")
    clipped = build_workload(spec, ModelTarget(vocab_size=1000, max_model_len=LIMIT))
    full = build_workload(spec, ModelTarget(vocab_size=1000, max_model_len=10**6))
    return clipped, full


@pytest.mark.parametrize("i", range(len(CASES)))
def test_hand_computed_clipping(replay, i):
    clipped, full = replay
    want_prompt, want_output, want_blocks = CASES[i][1]
    got, before = clipped.requests[i], full.requests[i]
    assert (got.num_prompt_tokens, got.max_new_tokens, got.prefix_blocks) == (want_prompt, want_output, want_blocks)
    assert got.prompt_ids == before.prompt_ids[:want_prompt]  # the prompt's first tokens, token for token
    assert got.num_prompt_tokens + got.max_new_tokens <= LIMIT


def test_notes_count_the_clipped_requests(replay):
    clipped, full = replay
    over = sum(i + o > LIMIT for (i, o, _), _ in CASES)
    assert over == 7
    assert [n for n in clipped.notes if "clipped" in n] == [
        f"{over} of {len(CASES)} requests clipped to max_model_len {LIMIT} "
        f"(prompt cut to its first tokens, output to at most {LIMIT // 2}); --scale shrinks instead"
    ]
    assert not any("clipped" in n for n in full.notes)


@pytest.mark.parametrize(
    "limit, inp, out, want",
    [
        (1001, 2000, 2000, (501, 500)),  # odd limit: half is 500, the prompt gets 501
        (2, 10, 10, (1, 1)),  # the smallest limit a ModelTarget allows
        (3, 10, 10, (2, 1)),
    ],
)
def test_odd_and_tiny_limits(limit, inp, out, want):
    s = clip(RequestSkeleton(index=0, input_tokens=inp, output_tokens=out, blocks=(5,)), limit)
    assert (s.input_tokens, s.output_tokens) == want


def test_explicit_block_lengths_are_cut_with_the_prompt():
    """RAGPulse-style blocks of their own lengths: the block holding the cut is shortened, later
    blocks (and their kinds) dropped."""
    s = RequestSkeleton(
        index=0, input_tokens=1200, output_tokens=300, blocks=(7, 8, 9, 10),
        block_lengths=(512, 437, 200, 40), block_kinds=("sys_prompt", "sys_prompt", "passage", "question"),
    )
    cut = clip(s, LIMIT)  # output 300 fits under 500; prompt 1000 - 300 = 700 = 512 + 188
    assert (cut.input_tokens, cut.output_tokens) == (700, 300)
    assert (cut.blocks, cut.block_lengths, cut.block_kinds) == ((7, 8), (512, 188), ("sys_prompt", "sys_prompt"))
    at_boundary = clip(s, 1100)  # output 300, prompt 800: still inside block 8 (512..949)
    assert (at_boundary.blocks, at_boundary.block_lengths) == ((7, 8), (512, 288))
    first_only = clip(s, 1024)  # output 300 <= 512, prompt 724 -> 512 + 212
    assert first_only.block_lengths == (512, 212)
    exact = clip(s, 812)  # output 300 <= 406, prompt 512: block 8 starts at the cut and goes
    assert (exact.blocks, exact.block_lengths, exact.block_kinds) == ((7,), (512,), ("sys_prompt",))


def test_explicit_block_lengths_end_to_end(tmp_path):
    """The same rule through a pwbench JSONL replay, with the cut block's tokens kept."""
    path = tmp_path / "t.jsonl"
    header = {"pwbench_trace": 1, "block_tokens": 512, "has_sessions": False}
    row = {"arrival_s": 0.0, "input_tokens": 1200, "output_tokens": 700, "blocks": [7, 8, 9],
           "block_lengths": [512, 437, 200], "block_kinds": ["sys_prompt", "sys_prompt", "passage"]}
    path.write_text(json.dumps(header) + "\n" + json.dumps(row) + "\n")
    clipped = build_workload(WorkloadSpec(f"trace:{path}"), ModelTarget(1000, LIMIT)).requests[0]
    full = build_workload(WorkloadSpec(f"trace:{path}"), ModelTarget(1000, 10**6)).requests[0]
    # output 700 -> 500; prompt 1000 - 500 = 500, inside block 7
    assert (clipped.num_prompt_tokens, clipped.max_new_tokens) == (500, 500)
    assert (clipped.prefix_blocks, clipped.block_lengths) == ((7,), (500,))
    assert clipped.prompt_ids == full.prompt_ids[:500]
