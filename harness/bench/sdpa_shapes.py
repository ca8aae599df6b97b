"""What a new attention shape costs on a GPU: decode-shaped SDPA calls as this runtime makes them.

    python -m harness.bench.sdpa_shapes [--contexts 16-1024] [--step 16]

The runtime's decode attention (engines/runtime/attention.py `paged_attention`) gathers each
group's KV blocks and calls SDPA with a boolean mask over [KV heads, sequences, query heads per
KV head, context]; the context grows by one block every block_size tokens, so a decode run meets
a new shape every few steps. This times, for each context length, the first call of that shape
and the median of 5 repeats, with SDPA free to choose its backend (PyTorch's priority) and with
the cuDNN backend disabled (`torch.backends.cuda.enable_cudnn_sdp(False)`), and prints the
totals. On a backend that builds a plan per shape (cuDNN builds a graph for each new sequence
length) the first calls dominate a decode run. CUDA only.
"""

from __future__ import annotations

import argparse
import time


def timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def sweep(contexts: list[int], cudnn: bool, seqs: int = 6, kv_heads: int = 8, group: int = 4,
          head_dim: int = 128) -> tuple[float, float]:
    """(sum of first calls, sum of repeat medians) over `contexts`, seconds."""
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    first = steady = 0.0
    for n in contexts:
        q = torch.randn(kv_heads, seqs, group, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(kv_heads, seqs, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = torch.ones(1, seqs, 1, n, dtype=torch.bool, device="cuda")  # as AttentionGroup.mask

        def call() -> None:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        first += timed(call)
        steady += sorted(timed(call) for _ in range(5))[2]
    return first, steady


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="16-1024", help="context lengths LO-HI")
    parser.add_argument("--step", type=int, default=16, help="context step (the KV block size)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sdpa_shapes: needs a CUDA GPU")
    lo, hi = (int(x) for x in args.contexts.split("-"))
    contexts = list(range(lo, hi + 1, args.step))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{len(contexts)} context lengths {lo}..{hi}")
    sweep([lo], True)  # the process's first CUDA calls
    for cudnn in (True, False, True):
        first, steady = sweep(contexts, cudnn)
        print(f"cuDNN SDPA {'allowed ' if cudnn else 'disabled'}: first calls {first * 1e3:8.1f} ms in all "
              f"({first / len(contexts) * 1e3:.2f} ms each), repeats {steady * 1e3:7.1f} ms in all "
              f"({steady / len(contexts) * 1e3:.3f} ms each)")
        contexts = [c + 1 for c in contexts]  # new shapes for the next pass


if __name__ == "__main__":
    main()
