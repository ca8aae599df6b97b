"""How much of a workload's prompts repeat an earlier prompt's prefix, from its metadata.

`repeated_prefix_tokens` reads only `Request.prefix_blocks` / `block_lengths` / `block_tokens`
(no token ids, so a deferred workload is not synthesized): the upper limit on what a prefix
cache that keeps every block could save. It does not model eviction, KV block rounding or
requests in flight at the same time; an engine's `prefix_cache_hit_rate` is measured, not this.
"""

from __future__ import annotations

from collections.abc import Iterable

from workloads.base import Request
from workloads.traces.common import block_spans


def prefix_spans(request: Request) -> list[tuple[int, int]]:
    """(block id, tokens of the prompt it covers) for the request's leading blocks, cut at the
    prompt's end; the prompt's own tokens after the blocks are in none."""
    n = request.num_prompt_tokens
    spans = block_spans(request.prefix_blocks, request.block_lengths, request.block_tokens, n)
    out, start = [], 0
    for block, span in zip(request.prefix_blocks, spans):
        span = max(0, min(span, n - start))
        out.append((block, span))
        start += span
    return out


def repeated_prefix(requests: Iterable[Request]) -> list[int]:
    """Per request, in the order given (a workload lists its requests in send order): the
    tokens of its longest leading chain of blocks equal to the leading chain of some earlier
    request. Blocks are equal when id and length are; where the chains first differ only in
    a block's length, the shorter one's tokens count too (a block cut short holds the first
    tokens of its id's block, workloads/synth.py), and the match ends there."""
    root: dict[int, dict[int, dict]] = {}  # trie: block id -> length -> child
    matched = []
    for request in requests:
        chain = prefix_spans(request)
        node, tokens = root, 0
        for block, span in chain:
            lengths = node.get(block)
            if lengths is None:
                break
            if span not in lengths:
                tokens += min(span, max(lengths))
                break
            tokens += span
            node = lengths[span]
        matched.append(tokens)
        node = root
        for block, span in chain:
            node = node.setdefault(block, {}).setdefault(span, {})
    return matched


def repeated_prefix_tokens(requests: Iterable[Request]) -> tuple[int, int]:
    """(prompt tokens repeating an earlier request's prefix, all prompt tokens); see
    `repeated_prefix` for what repeats."""
    requests = list(requests)
    return sum(repeated_prefix(requests)), sum(r.num_prompt_tokens for r in requests)
