"""Weights packed once for MKL's float32 GEMM on CPU.

On CPU, F.linear hands the weight to MKL's sgemm, which first copies it into its own packed
layout and then multiplies, on every call. For the matmuls of a decode step that copy is a
large share of the call: a 64-row batch against a 3 MiB expert matrix, or 256 rows against a
62 MiB LM head. MKL can pack a matrix once (cblas_sgemm_pack) and multiply against the packed
copy (cblas_sgemm_compute); torch exposes that pair as `torch.ops.mkl._mkl_reorder_linear_weight`
and `torch.ops.mkl._mkl_linear`, the ops Inductor's CPU weight freezing uses.
`python -m harness.bench.cpu_ops` times both on the benchmark model's shapes.

- The same numbers: from MIN_ROWS rows up MKL runs the same kernel either way, and the output
  is bitwise F.linear's (tests/unit/test_gemm.py checks it across shapes and row counts).
  Below MIN_ROWS, F.linear takes other kernels (results differ in the last bits), so those
  calls stay F.linear's: greedy tokens never depend on whether a weight was packed.
- One pack serves every row count: the row count given at pack time is a hint to MKL's
  blocking, and each call passes its own (the test covers 16 to 1000 rows).
- The packed copy is the weight's bytes a second time, in host RAM. Engines pack only what
  stays resident (the LM head, resident experts): a weight that streams in each step would be
  packed each step, which costs what it saves. On a CPU run the device budget models a GPU's
  memory, where nothing is packed, so these bytes are reported apart (`prepacked_bytes`) and
  not charged to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_ROWS = 16  # below this F.linear's kernel differs (and packing saves little)
PACK_HINT_ROWS = 64  # the row count MKL's packing is told to expect


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight and MKL's packed copy of it (an opaque tensor)."""

    weight: Tensor
    packed: Tensor

    @property
    def nbytes(self) -> int:
        """The packed copy's bytes, taken as the weight's (MKL's layout pads a few percent)."""
        return self.weight.numel() * self.weight.element_size()


def can_pack(weight: Tensor) -> bool:
    """A 2-D float32 CPU weight, with torch built against MKL."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def pack(weight: Tensor) -> PackedWeight | Tensor:
    """`weight` with its packed copy, or `weight` itself where it cannot be packed."""
    if not can_pack(weight):
        return weight
    with torch.inference_mode(False):
        return PackedWeight(weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_HINT_ROWS))


def linear(x: Tensor, weight: Tensor | PackedWeight, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) for a plain or a packed weight."""
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows < MIN_ROWS or bias is not None or x.dtype != torch.float32:
        return F.linear(x, weight.weight, bias)
    return torch.ops.mkl._mkl_linear(x, weight.packed, weight.weight, None, rows)


def packed_bytes(weights) -> int:
    """Bytes of the packed copies among `weights` (plain tensors count 0)."""
    return sum(w.nbytes for w in weights if isinstance(w, PackedWeight))
