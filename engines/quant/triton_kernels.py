"""Triton kernels for quantized weights: one grouped dequant-matmul serving both public ops.

Imported only on the Triton path (ops.py), so `import engines.quant` never imports triton.
`dequant_matmul` is the kernel with one expert and no row gather; `fused_moe` launches it
twice: gate_up with SwiGLU fused (gate and up tiles in one program, gpt-oss's biases and
clamp in the epilogue), then down with its bias and the routing weight applied, and sums each
token's rows back with index_add_. Weights are pwbench's group-wise codes or MXFP4 (E2M1
codes, one E8M0 scale byte per 32 inputs), decoded in the tile loader.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engines.quant.configs import KernelConfig, pick_config
from engines.quant.qweight import QuantizedExperts, QuantizedWeight
from engines.runtime.experts import Dispatch
from engines.runtime.mxfp4 import GROUP as MXFP4_GROUP
from engines.runtime.mxfp4 import Mxfp4Experts, Mxfp4Weight


@triton.jit
def _load_codes(row_ptrs, index, mask, BITS: tl.constexpr):
    """Codes number `index` of each row's dense little-endian bit stream, as float32.

    row_ptrs: int32 pointers to word 0 of each row; index broadcasts against them. A 3-bit
    code may straddle two words: its high bits come from the next word.
    """
    bit = (index * BITS).to(tl.uint32)
    shift = bit % 32
    word = (bit // 32).to(tl.int32)
    v = tl.load(row_ptrs + word, mask=mask, other=0).to(tl.uint32, bitcast=True) >> shift
    if 32 % BITS != 0:
        spill = mask & (shift + BITS > 32)
        hi = tl.load(row_ptrs + word + 1, mask=spill, other=0).to(tl.uint32, bitcast=True)
        v = v | (hi << ((32 - shift) % 32))  # shift by < 32: hi is 0 where nothing spills
    return (v & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _load_code_tile(q_rows, k0, n_mask, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Codes k0 .. k0+BLOCK_K of each row as float32 [BLOCK_N, BLOCK_K].

    When codes never straddle words (2, 4, 8 bits) each word is loaded once and split with
    shifts; 3-bit codes gather their word (and the next one) per code.
    """
    if 32 % BITS == 0:
        PER_WORD: tl.constexpr = 32 // BITS
        words = tl.load(q_rows + (k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD))[None, :],
                        mask=n_mask[:, None], other=0).to(tl.uint32, bitcast=True)
        shifts = (tl.arange(0, PER_WORD) * BITS).to(tl.uint32)
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(codes, (words.shape[0], BLOCK_K)).to(tl.float32)  # code j*PER_WORD+i
    else:
        return _load_codes(q_rows, (k0 + tl.arange(0, BLOCK_K))[None, :], n_mask[:, None], BITS)


@triton.jit
def _mxfp4_tile(q_rows, s_rows, k0, n_mask, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """MXFP4 W[n, k] for columns k0 .. k0+BLOCK_K (BLOCK_K divides 32: one scale byte per row).

    q_rows: uint8 pointers to each row's bytes (two E2M1 codes each, low nibble first); the
    value is sign * (e == 0 ? m/2 : (1 + m/2) * 2^(e-1)) * 2^(scale - 127), exact in float32.
    """
    b = tl.load(q_rows + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :], mask=n_mask[:, None], other=0)
    nib = (b.to(tl.int32)[:, :, None] >> (tl.arange(0, 2) * 4)[None, None, :]) & 0xF
    codes = tl.reshape(nib, (b.shape[0], BLOCK_K))  # code 2j + i from nibble i of byte j
    e = (codes >> 1) & 3
    m = (codes & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0)))
    value = tl.where(codes >= 8, -mag, mag)
    group = tl.zeros((1, 1), dtype=tl.int32) + k0 // GROUP_SIZE
    s = tl.load(s_rows + group, mask=n_mask[:, None], other=127).to(tl.int32)
    # E8M0 -> float32 by its exponent bits; byte 0 is 2^-127, a subnormal: its bits are 1 << 22.
    scale = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)
    return value * scale


@triton.jit
def _dequant_tile(q_rows, s_rows, z_rows, g_ptr, k0, n_mask,
                  BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, SYMMETRIC: tl.constexpr,
                  HAS_G_IDX: tl.constexpr, MXFP4: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[n, k] for the tile's rows n and columns k0 .. k0+BLOCK_K, float32 [BLOCK_N, BLOCK_K]."""
    if MXFP4:
        return _mxfp4_tile(q_rows, s_rows, k0, n_mask, GROUP_SIZE, BLOCK_K)
    codes = _load_code_tile(q_rows, k0, n_mask, BITS, BLOCK_K)
    if HAS_G_IDX:
        group = tl.load(g_ptr + k0 + tl.arange(0, BLOCK_K))[None, :]  # act-order: any group per column
    else:
        # BLOCK_K divides GROUP_SIZE: one group per K step, as a [1, 1] block so the masks
        # in _load_codes stay blocks too.
        group = tl.zeros((1, 1), dtype=tl.int32) + k0 // GROUP_SIZE
    scale = tl.load(s_rows + group, mask=n_mask[:, None], other=0.0).to(tl.float32)
    if SYMMETRIC:
        zero = 2.0 ** (BITS - 1)
    else:
        zero = _load_codes(z_rows, group, n_mask[:, None], BITS)
    return (codes - zero) * scale


@triton.jit
def _qmm_kernel(
    # pointers
    a_ptr, gather_ptr, route_w_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, c_ptr, blocks_ptr,
    # sizes, and the clamped SwiGLU's limit and alpha
    N, K, num_blocks, limit, alpha,
    # strides (packed words, scales, zeros and g_idx are contiguous along their last dim)
    stride_am, stride_ak, stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn,
    stride_ge, stride_be, stride_cm, stride_cn,
    # constexprs
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_G_IDX: tl.constexpr,
    MXFP4: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr, ROUTE_W: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[r, n] = sum_k A[row(r), k] * W_e[n, k] for the rows r of one expert's block.

    blocks int32 [3, num_blocks]: (expert, first row, end row) of each BLOCK_M slice of the
    expert-sorted rows; program (i, j) computes block i, columns [j*BLOCK_N, (j+1)*BLOCK_N).
    A [rows_a, K] read at row gather[r] (GATHER) or r; W_e [N, K] (or [2N, K] with SWIGLU:
    C = silu(A W_gate^T) * (A W_up^T), up rows at n + N) from packed codes q [E, *, K*BITS/32],
    scales s [E, *, K/GROUP_SIZE], zeros z [E, *, words] unless SYMMETRIC, g_idx [E, K] if
    HAS_G_IDX; with MXFP4, q holds E2M1 bytes [E, *, K/2] and s E8M0 bytes [E, *, K/32].
    HAS_BIAS adds bias [E, N or 2N] to the products; CLAMP makes the SwiGLU gpt-oss's
    (gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)). ROUTE_W scales row
    r by route_w[r]. C [rows, N], accumulation in float32.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(blocks_ptr + pid_m).to(tl.int64)
    rows = tl.load(blocks_ptr + num_blocks + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(blocks_ptr + 2 * num_blocks + pid_m)
    a_rows = tl.load(gather_ptr + rows, mask=row_mask, other=0) if GATHER else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    q_rows = q_ptr + expert * stride_qe + offs_n[:, None] * stride_qn
    s_rows = s_ptr + expert * stride_se + offs_n[:, None] * stride_sn
    z_rows = z_ptr + expert * stride_ze + offs_n[:, None] * stride_zn
    g_row = g_ptr + expert * stride_ge
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K: no K mask
        a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        w = _dequant_tile(q_rows, s_rows, z_rows, g_row, k0, n_mask,
                          BITS, GROUP_SIZE, SYMMETRIC, HAS_G_IDX, MXFP4, BLOCK_K)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            w_up = _dequant_tile(q_rows + N * stride_qn, s_rows + N * stride_sn, z_rows + N * stride_zn,
                                 g_row, k0, n_mask, BITS, GROUP_SIZE, SYMMETRIC, HAS_G_IDX, MXFP4, BLOCK_K)
            acc_up = tl.dot(a, tl.trans(w_up.to(a.dtype)), acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    if HAS_BIAS:
        b_row = bias_ptr + expert * stride_be
        acc += tl.load(b_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        if CLAMP:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTE_W:
        acc = acc * tl.load(route_w_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def block_table(counts: list[int], block_m: int, device: torch.device) -> Tensor:
    """int32 [3, blocks]: (expert, first row, end row) per BLOCK_M slice; empty experts get none."""
    table: list[tuple[int, int, int]] = []
    start = 0
    for e, n in enumerate(counts):
        table += [(e, s, start + n) for s in range(start, start + n, block_m)]
        start += n
    return torch.tensor(table, dtype=torch.int32).T.contiguous().to(device)


def qmm(a: Tensor, w: QuantizedWeight | Mxfp4Weight, counts: list[int], out_n: int, *,
        gather: Tensor | None = None, route_w: Tensor | None = None, swiglu: bool = False,
        bias: Tensor | None = None, clamp: tuple[float, float] | None = None,
        config: KernelConfig | None = None) -> Tensor:
    """Launcher: a [rows_a, K], w stacked [E, N or 2N, K], rows sorted by expert, bias [E, N or 2N]
    -> C [sum(counts), out_n]."""
    # check
    num_experts, k = w.lead[0], w.shape[1]
    rows = sum(counts)
    assert a.shape[1] == k and len(counts) == num_experts and w.shape[0] == out_n * (2 if swiglu else 1)
    assert bias is None or tuple(bias.shape) == (num_experts, w.shape[0])
    assert clamp is None or swiglu
    # allocate
    c = torch.empty(rows, out_n, dtype=a.dtype, device=a.device)
    if rows == 0:
        return c
    # pick config
    mxfp4 = isinstance(w, Mxfp4Weight)
    bits, group_size = (4, MXFP4_GROUP) if mxfp4 else (w.bits, w.group_size)
    cfg = config or pick_config(num_experts, w.shape[0], k, bits, group_size, a.dtype, rows, a.device)
    blocks = block_table(counts, cfg.block_m, a.device)
    if mxfp4:
        qdata, scales = w.blocks.flatten(-2).contiguous(), w.scales.contiguous()  # [E, N, K/2] bytes
        zeros = g_idx = qdata
        symmetric, has_g_idx = True, False
    else:
        qdata, scales = w.qdata.contiguous(), w.scales.contiguous()
        zeros = qdata if w.zeros is None else w.zeros.contiguous()  # placeholder pointer when unused
        g_idx = qdata if w.g_idx is None else w.g_idx.contiguous()
        symmetric, has_g_idx = w.symmetric, w.g_idx is not None
    bias_t = scales if bias is None else bias.contiguous()
    limit, alpha = clamp if clamp is not None else (0.0, 0.0)
    # launch
    grid = (blocks.shape[1], triton.cdiv(out_n, cfg.block_n))
    _qmm_kernel[grid](
        a, gather if gather is not None else blocks, route_w if route_w is not None else a,
        qdata, scales, zeros, g_idx, bias_t, c, blocks,
        out_n, k, blocks.shape[1], float(limit), float(alpha),
        a.stride(0), a.stride(1), qdata.stride(0), qdata.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1), g_idx.stride(0), bias_t.stride(0), c.stride(0), c.stride(1),
        BITS=bits, GROUP_SIZE=group_size, SYMMETRIC=symmetric, HAS_G_IDX=has_g_idx, MXFP4=mxfp4,
        GATHER=gather is not None, SWIGLU=swiglu, HAS_BIAS=bias is not None, CLAMP=clamp is not None,
        ROUTE_W=route_w is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def dequant_matmul(x: Tensor, qw: QuantizedWeight | Mxfp4Weight) -> Tensor:
    """x [T, in] @ dequantize(qw)^T -> [T, out] (inputs checked by ops.dequant_matmul / mxfp4_matmul)."""
    one_expert = qw.map_tensors(lambda t: t.unsqueeze(0))
    return qmm(x, one_expert, [x.shape[0]], qw.shape[0])


def fused_moe(x: Tensor, d: Dispatch, experts: QuantizedExperts | Mxfp4Experts) -> Tensor:
    """x [T, D] -> sum over each token's experts of weight * SwiGLU expert(x) (see ops.fused_moe)."""
    inter = experts.down.shape[1]
    act = qmm(x, experts.gate_up, d.counts, inter, gather=d.token_index, swiglu=True, bias=experts.gate_up_bias,
              clamp=experts.clamp)
    y = qmm(act, experts.down, d.counts, x.shape[1], route_w=d.weights, bias=experts.down_bias)
    return torch.zeros_like(x).index_add_(0, d.token_index, y)
