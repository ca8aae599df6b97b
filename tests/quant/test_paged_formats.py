"""PagedWeight's expert versions (engines/pagedweight/formats.py) against independent oracles.

Oracles: engines.quant.qweight's quantize_rtn + dequantize (re-quantize versions, and the 8-bit
copy the planes are cut from); a per-element loop written here for the bit-plane midpoint
formula; byte counts from the shapes; the runtime's swiglu for 16 bits and for every version's
dequantized weights. The error table on the demo model's experts is printed (pytest -s).
"""

from __future__ import annotations

import math

import pytest
import torch

from engines.pagedweight.formats import (
    FULL,
    dequantize_planes,
    make_store,
    split_planes,
    top_codes,
    top_codes_u8,
)
from engines.quant.ops import kernel_impl
from engines.quant.qweight import dequantize, quantize_rtn, unpack
from engines.runtime.experts import swiglu

REPS = ("requantize", "bitplanes")
BITS = (16, 8, 4, 3, 2)
GS = 32


def expert(seed: int, hidden: int = 128, inter: int = 64, scale: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * inter, hidden, generator=g) * scale, torch.randn(hidden, inter, generator=g) * scale)


def rows(n: int, hidden: int = 128, seed: int = 100) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).pow(2).sum() / ref.pow(2).sum())


# --- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_requantize_versions_are_rtn_of_the_master(bits):
    gate_up, down = expert(0)
    store = make_store("requantize", gate_up, down, BITS, GS)
    got = store.version(bits).weights(torch.float32)
    for w, g in zip((gate_up, down), got):
        assert torch.equal(g, dequantize(quantize_rtn(w, bits, GS), torch.float32))


def test_bitplanes_at_8_bits_are_8_bit_rtn_exactly():
    gate_up, down = expert(1)
    store = make_store("bitplanes", gate_up, down, BITS, GS)
    for w, g in zip((gate_up, down), store.version(8).weights(torch.float32)):
        assert torch.equal(g, dequantize(quantize_rtn(w, 8, GS), torch.float32))


def loop_reference(w: torch.Tensor, n: int) -> torch.Tensor:
    """Per element: the top n bits of the 8-bit RTN code, dequantized at the midpoint of the
    2^(8-n) codes that share them: ((code_n + 0.5) * 2^(8-n) - 0.5 - zero_8) * scale_8."""
    qw = quantize_rtn(w, 8, GS)
    codes, zeros = unpack(qw)
    scales = qw.scales
    out = torch.empty(w.shape, dtype=torch.float64)
    step = 2 ** (8 - n)
    for r in range(w.shape[0]):
        for c in range(w.shape[1]):
            top = int(codes[r, c]) >> (8 - n)
            z, s = int(zeros[r, c // GS]), float(scales[r, c // GS])
            out[r, c] = ((top + 0.5) * step - 0.5 - z) * s
    return out


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_bitplanes_below_8_bits_match_a_loop_reference(bits):
    gate_up, down = expert(2, hidden=32, inter=32)
    store = make_store("bitplanes", gate_up, down, BITS, GS)
    for w, g in zip((gate_up, down), store.version(bits).weights(torch.float32)):
        torch.testing.assert_close(g.double(), loop_reference(w, bits), rtol=2e-7, atol=1e-9)


def test_planes_round_trip_and_every_width_follows_the_formula():
    codes = torch.randint(0, 256, (3, 5, 64), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    planes = split_planes(codes)
    assert len(planes) == 8 and all(p.shape == (3, 5, 8) and p.dtype == torch.uint8 for p in planes)
    assert torch.equal(top_codes(planes), codes)
    scales, zeros = torch.rand(3, 5, 2) + 0.1, torch.randint(0, 256, (3, 5, 2), dtype=torch.uint8)
    for n in range(1, 9):
        assert torch.equal(top_codes(planes[:n]), codes >> (8 - n))
        fast = top_codes_u8(planes[:n])  # the byte-lane lookup dequantize_planes uses
        assert fast.dtype == torch.uint8 and torch.equal(fast.to(torch.int32), codes >> (8 - n))
        want = ((codes >> (8 - n)).double() + 0.5) * 2 ** (8 - n) - 0.5
        want = (want - zeros.double().repeat_interleave(32, -1)) * scales.double().repeat_interleave(32, -1)
        torch.testing.assert_close(dequantize_planes(planes[:n], scales, zeros, 32, torch.float64), want)


# --- bytes ------------------------------------------------------------------------------------


def demo_bytes(rep: str, bits: int, hidden: int = 128, inter: int = 64, scale_bytes: int = 4) -> int:
    """From the shapes: gate_up [2I, D] and down [D, I], groups of 32 along the input."""
    mats = ((2 * inter, hidden), (hidden, inter))
    if bits == FULL:
        return sum(o * i for o, i in mats) * scale_bytes
    total = 0
    for out, inp in mats:
        groups = inp // GS
        if rep == "requantize":  # packed codes, scales, zero codes packed in int32 words
            total += out * inp * bits // 8 + out * groups * scale_bytes + out * math.ceil(groups * bits / 32) * 4
        else:  # `bits` planes of out*in/8 bytes, 8-bit scales, uint8 zeros
            total += bits * out * inp // 8 + out * groups * scale_bytes + out * groups
    return total


@pytest.mark.parametrize("rep", REPS)
def test_bytes_per_version_match_the_shapes(rep):
    store = make_store(rep, *expert(4), BITS, GS)
    sizes = {b: store.nbytes(b) for b in BITS}
    assert sizes == {b: demo_bytes(rep, b) for b in BITS}
    print(f"\n{rep} bytes per expert (D 128, I 64, float32): {sizes}")


def test_bitplane_moves_copy_and_free_exactly_planes():
    store = make_store("bitplanes", *expert(5), BITS, GS)
    plane = (128 * 128 + 128 * 64) // 8  # one plane of gate_up and of down
    shared = store.nbytes(2) - 2 * plane
    assert shared == 128 * 4 * 4 + 128 * 4 + 128 * 2 * 4 + 128 * 2  # scales + zeros of both matrices
    quantized = [8, 4, 3, 2]
    for m in quantized:
        for n in quantized:
            if n < m:  # demotion: frees the trailing planes, copies nothing
                assert store.transfer_bytes(m, n) == 0
                assert store.freed_bytes(m, n) == (m - n) * plane == store.nbytes(m) - store.nbytes(n)
                held = {k: t.clone() for k, t in store.parts(m).items()}  # "device" copy of version m
                parts, pairs = store.device_tensors(n, "cpu", held)
                assert pairs == [] and all(parts[k] is held[k] for k in parts)
                trailing = {f"{w}.plane{j}" for w in ("gate_up", "down") for j in range(n + 1, m + 1)}
                assert set(held) - set(parts) == trailing
            elif n > m:  # promotion: copies the missing planes only
                assert store.transfer_bytes(m, n) == (n - m) * plane and store.freed_bytes(m, n) == 0
                held = {k: t.clone() for k, t in store.parts(m).items()}
                parts, pairs = store.device_tensors(n, "cpu", held)
                copied = {k for k, t in parts.items() if any(t is dst for dst, _ in pairs)}
                assert copied == {f"{w}.plane{j}" for w in ("gate_up", "down") for j in range(m + 1, n + 1)}
                assert sum(src.numel() * src.element_size() for _, src in pairs) == store.transfer_bytes(m, n)
                for dst, src in pairs:
                    dst.copy_(src)
                assert torch.equal(store.version(n, parts).weights(torch.float32)[0],
                                   store.version(n).weights(torch.float32)[0])
        # 16 bits is the master: nothing shared with the planes.
        assert store.transfer_bytes(m, FULL) == store.nbytes(FULL)
        assert store.transfer_bytes(FULL, m) == store.nbytes(m) == store.transfer_bytes(0, m)
    # The host tier keeps the master, 8 planes and the shared scales/zeros once.
    assert store.host_bytes() == store.nbytes(FULL) + store.nbytes(8)


def test_requantize_moves_copy_the_whole_version():
    store = make_store("requantize", *expert(6), BITS, GS)
    for a in BITS:
        for b in BITS:
            if a != b:  # a demotion too: the lower version's own codes have to come in
                assert store.transfer_bytes(a, b) == store.nbytes(b)
                assert store.freed_bytes(a, b) == store.nbytes(a)
                assert sum(s.numel() * s.element_size() for _, s in store.device_tensors(b, "cpu", store.parts(a))[1]) \
                    == store.nbytes(b)
    assert store.host_bytes() == sum(store.nbytes(b) for b in BITS)


# --- compute ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rep", REPS)
def test_16_bits_is_the_master_bit_for_bit(rep):
    gate_up, down = expert(7)
    store = make_store(rep, gate_up, down, BITS, GS)
    x = rows(33)
    assert torch.equal(store.forward(store.parts(16), 16, x), swiglu(x, gate_up, down))
    assert torch.equal(store.group_forward([store.parts(16)], 16, [x])[0], swiglu(x, gate_up, down))


@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_forward_is_swiglu_of_the_dequantized_version(rep, bits):
    gate_up, down = expert(8)
    store = make_store(rep, gate_up, down, BITS, GS)
    x = rows(17)
    torch.testing.assert_close(store.forward(store.parts(bits), bits, x),
                               swiglu(x, *store.version(bits).weights(torch.float32)))


@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("bits", [16, 8, 4, 3, 2])
def test_group_forward_equals_each_experts_forward(rep, bits):
    stores = [make_store(rep, *expert(10 + g), BITS, GS) for g in range(4)]
    xs = [rows(n, seed=20 + n) for n in (5, 0, 12, 1)]  # an expert with no rows, too
    got = stores[0].group_forward([s.parts(bits) for s in stores], bits, xs)
    assert [tuple(y.shape) for y in got] == [tuple(x.shape) for x in xs]
    for s, x, y in zip(stores, xs, got):
        want = s.forward(s.parts(bits), bits, x)
        if kernel_impl() == "torch":  # the same math on the same rows
            assert torch.equal(y, want)
        else:  # Triton: the fused kernel and dequant_matmul sum in different orders
            torch.testing.assert_close(y, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_group_weights_are_each_experts_dequantized_weights(bits):
    """The stacked dequantize `pwbench hw` times (measure_cpu_group_dequant) is each expert's own."""
    stores = [make_store("bitplanes", *expert(40 + g), BITS, GS) for g in range(3)]
    w = stores[0].group_weights([s.parts(bits) for s in stores], bits, torch.float32)
    inter, hidden = stores[0].shape
    for g, s in enumerate(stores):
        gate_up, down = s.version(bits).weights(torch.float32)
        assert torch.equal(w["gate_up"][g][:, :hidden], gate_up) and torch.equal(w["down"][g][:, :inter], down)


@pytest.mark.parametrize("rep", REPS)
def test_error_decreases_with_bits_on_random_weights(rep):
    x = rows(64)
    errors = {b: 0.0 for b in BITS}
    for seed in range(4):
        gate_up, down = expert(30 + seed)
        store = make_store(rep, gate_up, down, BITS, GS)
        ref = swiglu(x, gate_up, down)
        for b in BITS:
            errors[b] += rel_error(store.forward(store.parts(b), b, x), ref) / 4
    assert errors[16] == 0.0
    assert errors[8] < errors[4] < errors[3] < errors[2], errors


def test_bitplanes_vs_requantize_on_the_demo_models_experts():
    """Mean relative output error over the demo model's 8 experts on unit-Gaussian rows (the
    calibrated table, on the rows the router sends, is tests/integration/test_paged_sensitivity)."""
    from engines.common.demo import DEMO_MODEL_DIR

    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.skip("engines/demo_model is not built")
    from engines.runtime.checkpoint import load_weights, open_checkpoint
    from engines.runtime.transfer import TransferLedger

    device = torch.device("cpu")
    _, dense = load_weights(open_checkpoint(DEMO_MODEL_DIR), device, torch.float32, TransferLedger(device))
    x = rows(256)
    table = {rep: {b: 0.0 for b in (8, 4, 3, 2)} for rep in REPS}
    experts = [(i, e) for i, w in dense.items() for e in range(w.num_experts)]
    for i, e in experts:
        gate_up, down = dense[i].gate_up[e], dense[i].down[e]
        ref = swiglu(x, gate_up, down)
        for rep in REPS:
            store = make_store(rep, gate_up, down, BITS, GS)
            for b in table[rep]:
                table[rep][b] += rel_error(store.forward(store.parts(b), b, x), ref) / len(experts)
    print("\nmean relative output error on the demo model's experts (unit-Gaussian rows)")
    print("bits  requantize  bitplanes  bitplanes/requantize")
    for b in (8, 4, 3, 2):
        r, p = table["requantize"][b], table["bitplanes"][b]
        print(f"{b:>4}  {r:10.3e}  {p:9.3e}  {p / r:6.2f}")
    assert table["bitplanes"][8] == table["requantize"][8]  # the same 8-bit RTN weights
    for rep in REPS:
        t = table[rep]
        assert t[8] < t[4] < t[3] < t[2], (rep, t)
