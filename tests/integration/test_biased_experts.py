"""Biased, clamped experts (gpt-oss) and odd expert widths in every expert backend.

Oracles: transformers' own greedy generate() on the same tiny checkpoint (each prompt alone,
batch 1, its own biases and clamped SwiGLU); engine moe's `grouped_swiglu` for bit-identical
expert outputs; byte counts from the shapes; the budget itself after every step; rtn.py's
any-group RTN for the padded last group.
"""

from __future__ import annotations

import re

import pytest
import torch
from engine_runs import random_requests, run_engine
from tiny_models import ARCH_KWARGS, CPU32, build_hf_model, save_checkpoint

from engines.base import EngineError
from engines.pagedweight.formats import fit_group_size, make_store
from engines.quant.rtn import fake_quantized, rtn_fake_quantize
from engines.registry import create_engine
from engines.runtime.checkpoint import open_checkpoint
from engines.runtime.copies import CopyEngine
from engines.runtime.experts import ResidentBackend, dispatch, route, swiglu
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import DenseExperts
from harness.calibration import create_calibrated

NEW = 8
REQS = random_requests(257, n=4, new=NEW, seed=3, lo=3, hi=40)
ROOMY = 64 << 20  # every tiny model's experts at 16 bits with room to spare
FAST = {"calib_prompts": 2}  # pagedweight/full calibration: two random prompts are enough here


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch) -> (folder, request id -> transformers' greedy tokens), built once per module."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            model = build_hf_model(arch)
            folder = save_checkpoint(model, tmp_path_factory.mktemp(arch) / arch)
            with torch.inference_mode():
                tokens = {r.request_id: model.generate(
                    torch.tensor([r.prompt_ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                    pad_token_id=0)[0, len(r.prompt_ids):].tolist() for r in REQS}
            cache[arch] = folder, tokens
        return cache[arch]

    return get


def generate(name: str, folder, **options):
    engine = create_calibrated(name, {"model": str(folder), **CPU32, **options})
    got, steps, info = run_engine(engine, REQS)
    return got, steps, info, engine


# --- the same greedy tokens as transformers ------------------------------------------------------

CASES = {
    "offload-1-slot": ("offload", {"experts_per_layer": 1}),
    "offload-2-lfu": ("offload", {"experts_per_layer": 2, "policy": "lfu"}),
    "offload-3-prefetch": ("offload", {"experts_per_layer": 3, "prefetch": True}),
    "pagedweight-bitplanes": ("pagedweight", {"budget_bytes": ROOMY, **FAST}),
    "pagedweight-requantize": ("pagedweight", {"budget_bytes": ROOMY, "representation": "requantize", **FAST}),
    "moegen-resident": ("moegen", {"budget_bytes": ROOMY}),
    "moegen-streaming": ("moegen", {"budget_bytes": ROOMY, "resident_experts": 3, "expert_slots": 2}),
    "full": ("full", {"budget_bytes": ROOMY, **FAST}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_oss_greedy_tokens_equal_transformers(case, tiny):
    name, options = CASES[case]
    folder, want = tiny("gpt_oss")
    got, steps, _, _ = generate(name, folder, **options)
    assert got == want
    if name == "offload" and options["experts_per_layer"] < 6:  # experts really moved through the slots
        assert sum(s.extras["expert_cache_misses"] for s in steps) > 2 * options["experts_per_layer"]
    if name == "pagedweight":
        assert all(s.extras["mean_bits"] == 16 for s in steps)
    if case == "moegen-streaming":
        assert sum(s.extras["streamed_experts"] for s in steps) > 0


@pytest.mark.parametrize("name", ["offload", "pagedweight"])
def test_deepseek_v3_greedy_tokens_equal_transformers(name, tiny):
    options = {"experts_per_layer": 3, "prefetch": True} if name == "offload" else {"budget_bytes": ROOMY, **FAST}
    folder, want = tiny("deepseek_v3")
    got, _, _, engine = generate(name, folder, **options)
    assert got == want
    if name == "pagedweight":  # its experts are 24 wide: no group size divides, rows padded
        assert any("group_size 32 does not divide expert width 24" in n for n in engine.notes())


# --- bit for bit the resident computation -----------------------------------------------------------


def biased_stack(E: int = 5, D: int = 64, I: int = 32, dtype=torch.float32, seed: int = 0) -> DenseExperts:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return DenseExperts(r(E, 2 * I, D), r(E, D, I), r(E, 2 * I, scale=0.5), r(E, D, scale=0.5), (1.5, 1.702))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_and_page_backends_compute_biased_experts_bit_for_bit_as_grouped_swiglu(dtype):
    from engines.moegen.streaming import StreamingBackend
    from engines.offload.cache import OffloadBackend

    stack = biased_stack(dtype=dtype)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    router = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = route(x, router, 2, True)
    d = dispatch(ids, weights, torch.bincount(ids.flatten(), minlength=5).tolist())
    want = ResidentBackend({0: stack}).forward(0, x, d)
    cpu = torch.device("cpu")
    offload = OffloadBackend({0: stack}, 2, CopyEngine(TransferLedger(cpu), cpu), cpu)
    streaming = StreamingBackend({0: stack}, 2, {(0, 1)}, CopyEngine(TransferLedger(cpu), cpu), cpu)
    streaming.prepack()
    for backend in (offload, streaming):
        assert torch.equal(backend.forward(0, x, d), want)
    xs = x[d.token_index]
    for rep in ("bitplanes", "requantize"):
        for e in range(5):
            store = make_store(rep, stack.gate_up[e], stack.down[e], (16, 8), 32, gate_up_bias=stack.gate_up_bias[e],
                               down_bias=stack.down_bias[e], clamp=stack.clamp)
            rows = xs[:7]
            one = ResidentBackend({0: DenseExperts(stack.gate_up[e:e + 1], stack.down[e:e + 1],
                                                   stack.gate_up_bias[e:e + 1], stack.down_bias[e:e + 1],
                                                   stack.clamp)})
            d1 = dispatch(torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1, dtype=dtype), [7])
            assert torch.equal(store.forward(store.parts(16), 16, rows), one.forward(0, rows, d1))
            assert torch.equal(store.group_forward([store.parts(16)], 16, [rows])[0], one.forward(0, rows, d1))


# --- bytes: biases travel and count with their expert ----------------------------------------------


def test_offload_slots_hold_and_count_the_biases(tiny):
    from engines.offload.cache import OffloadBackend

    D, I = 64, 32
    per_expert = 4 * (2 * I * D + D * I + 2 * I + D)  # float32 weights and both biases
    stack, cpu = biased_stack(D=D, I=I), torch.device("cpu")
    ledger = TransferLedger(cpu)
    backend = OffloadBackend({0: stack, 1: stack}, 2, CopyEngine(ledger, cpu), cpu)
    assert backend.device_bytes() == 2 * 2 * per_expert  # 2 layers x 2 slots
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(11).remainder(5)[:, None]  # every expert gets tokens: 5 misses in 2 slots
    backend.forward(0, x, dispatch(ids, torch.ones(11, 1), torch.bincount(ids.flatten(), minlength=5).tolist()))
    assert backend.step_stats()["expert_cache_misses"] == 5
    assert ledger.total["h2d:experts"] == 5 * per_expert  # each copy: weights and biases
    kw = ARCH_KWARGS["gpt_oss"]
    _, _, info, _ = generate("offload", tiny("gpt_oss")[0], experts_per_layer=2)
    assert info.model_stats["bytes_per_expert"] == 4 * (3 * kw["hidden_size"] * kw["intermediate_size"]
                                                        + 2 * kw["intermediate_size"] + kw["hidden_size"])


def test_a_versions_biases_are_shared_parts_never_copied_by_a_width_change():
    stack = biased_stack()
    D, I = 64, 32
    bias_bytes = 4 * (2 * I + D)
    weights16 = 4 * 3 * I * D
    for rep in ("bitplanes", "requantize"):
        store = make_store(rep, stack.gate_up[0], stack.down[0], (16, 8, 4, 2), 32, gate_up_bias=stack.gate_up_bias[0],
                           down_bias=stack.down_bias[0], clamp=stack.clamp)
        assert store.nbytes(16) == weights16 + bias_bytes
        bare = make_store(rep, stack.gate_up[0], stack.down[0], (16, 8, 4, 2), 32)
        for b in (16, 8, 4, 2):
            assert store.nbytes(b) == bare.nbytes(b) + bias_bytes
            assert store.parts(b)["gate_up_bias"] is store.parts(16)["gate_up_bias"]
            assert torch.equal(store.parts(b)["down_bias"], stack.down_bias[0])
            for a in (16, 8, 4, 2):
                if a != b:
                    assert store.transfer_bytes(a, b) == bare.transfer_bytes(a, b)  # weights only
                    assert store.freed_bytes(a, b) == bare.freed_bytes(a, b)
            assert store.transfer_bytes(0, b) == store.nbytes(b)  # from nothing: biases too
            assert store.freed_bytes(b, 0) == store.nbytes(b)


@pytest.mark.parametrize("rep", ["bitplanes", "requantize"])
def test_quantized_biased_experts_group_as_they_run_alone(rep):
    """group_forward (requantize: the fused op with biases and clamp) = each expert's forward,
    and both are the SwiGLU of the dequantized weights with the exact biases."""
    stack = biased_stack(E=3)
    stores = [make_store(rep, stack.gate_up[e], stack.down[e], (16, 8, 4), 32, gate_up_bias=stack.gate_up_bias[e],
                         down_bias=stack.down_bias[e], clamp=stack.clamp) for e in range(3)]
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (4, 0, 9)]
    for b in (8, 4):
        got = stores[0].group_forward([s.parts(b) for s in stores], b, xs)
        for s, x, y in zip(stores, xs, got):
            torch.testing.assert_close(y, s.forward(s.parts(b), b, x))
            torch.testing.assert_close(y, swiglu(x, *s.version(b).weights(torch.float32), s.bias["gate_up_bias"],
                                                 s.bias["down_bias"], stack.clamp))


# --- budgets that force paging and demotion ---------------------------------------------------------


def minimum_budget(name: str, folder, **options) -> tuple[int, int]:
    """(the least budget `name` starts with on `folder`, bytes of one KV block) from a roomy start."""
    probe = create_calibrated(name, {"model": str(folder), **CPU32, "budget_bytes": ROOMY, **options})
    probe.start()
    try:
        return sum(n for _, n in probe.budget.parts()), probe.loaded.kv_block_bytes(probe.config.block_size)
    finally:
        probe.stop()


LONGEST = -(-(max(len(r.prompt_ids) for r in REQS) + NEW) // 4)  # KV blocks of 4 the longest request needs


def check_within(steps, budget: int, got: dict) -> None:
    assert sorted(got) == sorted(r.request_id for r in REQS) and all(len(t) == NEW for t in got.values())
    for s in steps:
        assert s.device_weight_bytes + s.device_kv_bytes <= budget


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_offload_at_tight_budgets_keeps_within_them_and_gives_transformers_tokens(arch, tiny):
    folder, want = tiny(arch)
    lowest, block = minimum_budget("offload", folder, block_size=4)
    for budget in (lowest + LONGEST * block, lowest + 3 * LONGEST * block):
        got, steps, info, _ = generate("offload", folder, budget_bytes=budget, block_size=4)
        check_within(steps, budget, got)
        assert got == want  # offloading never changes the computation
        assert info.model_stats["expert_slots_per_layer"] < open_checkpoint(folder).config.num_experts
    assert sum(s.extras["expert_cache_misses"] for s in steps) > 0


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_pagedweight_below_full_precision_keeps_its_budget_and_serves_every_request(arch, tiny):
    folder, _ = tiny(arch)
    options = {"floor_bits": 0, "max_expert_error": None, "bits": "16,8,4", "block_size": 4, **FAST}
    probe = create_calibrated("pagedweight", {"model": str(folder), **CPU32, "budget_bytes": ROOMY, **options})
    probe.start()
    stores, loaded = probe.paged.backend.stores, probe.loaded
    dense, full16, block = loaded.dense_bytes, sum(s.nbytes(16) for s in stores.values()), loaded.kv_block_bytes(4)
    probe.stop()
    budget = dense + full16 // 3 + 2 * LONGEST * block  # room for a third of the experts at 16 bits
    got, steps, _, engine = generate("pagedweight", folder, budget_bytes=budget, **options)
    check_within(steps, budget, got)
    assert min(s.extras["mean_bits"] for s in steps) < 16  # demoted or paged out: not vacuous


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_moegen_and_full_stream_within_a_tight_budget(arch, tiny):
    folder, want = tiny(arch)
    lowest, block = minimum_budget("moegen", folder, resident_experts=0, expert_slots=1, block_size=4)
    budget = lowest + 2 * LONGEST * block
    got, steps, _, _ = generate("moegen", folder, budget_bytes=budget, block_size=4)
    check_within(steps, budget, got)
    assert got == want
    lowest, block = minimum_budget("full", folder, block_size=4, **FAST)
    full_budget = lowest + 2 * LONGEST * block
    got, steps, _, _ = generate("full", folder, budget_bytes=full_budget, block_size=4, **FAST)
    check_within(steps, full_budget, got)


# --- group sizes that fit ---------------------------------------------------------------------------


@pytest.mark.parametrize(("asked", "widths", "picked"), [
    (32, [64, 2880], 32),  # divides: kept, no note
    (128, [2880], 64),  # 2880 = 64 * 45: the largest that divides
    (64, [96, 64], 32),
    (32, [64, 72], 32),  # none divides 72: padded rows, 72 -> 96
    (32, [64, 24], 32),  # DeepSeek-V3 tiny: 24 -> 32
    (128, [100], 128),  # every size pads 100 to 128: the asked one
])
def test_fit_group_size_picks_a_divisor_or_pads_and_says_which(asked, widths, picked):
    g, note = fit_group_size(asked, widths)
    assert g == picked
    if all(w % asked == 0 for w in widths):
        assert note is None
        return
    assert note.startswith(f"group_size {asked} does not divide expert width")
    if all(w % g == 0 for w in widths):
        assert f"experts quantized with group_size {g}" in note and "padded" not in note
    else:
        assert "padded" in note
        for w in widths:
            if w % g:
                assert f"{w} -> {-(-w // g) * g}" in note
    # every number the note calls a group size divides every width, or the note says rows are padded
    for n in map(int, re.findall(r"quantized with group_size (\d+)", note)):
        assert all(w % n == 0 for w in widths) or "padded" in note


def test_fit_group_size_refuses_an_unsupported_size_in_one_line():
    with pytest.raises(EngineError, match=r"group_size must be one of 128, 64, 32, got 20"):
        fit_group_size(20, [64])


@pytest.mark.parametrize("rep", ["bitplanes", "requantize"])
def test_a_padded_last_group_quantizes_as_its_real_weights_alone(rep):
    g = torch.Generator().manual_seed(5)
    D, I = 64, 20  # I: one group of 20 real inputs, padded to 32
    gate_up, down = torch.randn(2 * I, D, generator=g) * 0.1, torch.randn(D, I, generator=g) * 0.1
    bias = torch.randn(2 * I, generator=g), torch.randn(D, generator=g)
    store = make_store(rep, gate_up, down, (16, 8, 4, 3, 2), 32, gate_up_bias=bias[0], down_bias=bias[1],
                       clamp=(1.5, 1.702))
    x = torch.randn(9, D, generator=g)
    for b in (8, 4, 3, 2) if rep == "requantize" else (8,):
        gu, dn = store.version(b).weights(torch.float32)
        assert gu.shape == (2 * I, D) and dn.shape == (D, I)
        assert torch.equal(gu, rtn_fake_quantize(gate_up, b, 32))
        assert torch.equal(dn, rtn_fake_quantize(down, b, I))  # one group of the 20 real weights
    for b in (8, 4, 3, 2):
        version = store.version(b)
        torch.testing.assert_close(store.forward(store.parts(b), b, x), version.dense_forward(x))
        assert torch.equal(store.group_forward([store.parts(b)] * 2, b, [x, x[:3]])[1],
                           store.forward(store.parts(b), b, x[:3]))
    assert store.forward(store.parts(8), 8, x).sub(store.reference(x)).abs().max() < 0.05


def test_pagedweight_on_72_wide_experts_pads_says_so_and_gives_moes_tokens(checkpoints):
    folder = checkpoints("mixtral", intermediate_size=72)
    want, _, _, _ = generate("moe", folder)
    for name in ("pagedweight", "full"):
        got, _, info, engine = generate(name, folder, budget_bytes=ROOMY, **FAST)
        assert got == want
        note = next(n for n in engine.notes() if "group_size 32 does not divide expert width 72" in n)
        assert "72 -> 96" in note
        assert info.config["group_size"] == 32


# --- fake quantization (expert_bits) ----------------------------------------------------------------


def test_fake_quantized_rounds_weights_only_and_keeps_biases_and_clamp_exact():
    stack = biased_stack()
    out = fake_quantized({0: stack}, 4, 32)[0]
    assert out.gate_up_bias is stack.gate_up_bias and out.down_bias is stack.down_bias
    assert out.clamp == stack.clamp
    assert torch.equal(out.gate_up, rtn_fake_quantize(stack.gate_up, 4, 32))
    assert not torch.equal(out.gate_up, stack.gate_up)


def test_fake_quantized_suggests_a_group_size_that_divides_every_row():
    stack = DenseExperts(torch.zeros(2, 80, 64), torch.zeros(2, 64, 40))  # 40 % 32 = 8
    with pytest.raises(EngineError) as err:
        fake_quantized({0: stack}, 4, 32)
    fit = int(re.search(r"expert_group=(\d+)", str(err.value)).group(1))
    assert fit == 8 and 64 % fit == 0 and 24 % fit == 0


def test_moe_with_expert_bits_serves_gpt_oss(tiny):
    folder, want = tiny("gpt_oss")
    engine = create_engine("moe", {"model": str(folder), **CPU32, "expert_bits": 8})
    engine.start()
    try:
        stack = engine.experts.weights(engine.experts.layers()[0])
        assert stack.gate_up_bias is not None and stack.clamp is not None
    finally:
        engine.stop()
    got, _, _, _ = generate("moe", folder, expert_bits=8)
    agree = sum(a == b for r in got for a, b in zip(got[r], want[r]))
    assert agree >= 0.75 * NEW * len(REQS)  # 8-bit weights, exact biases: nearly every token


# --- quality feedback and sensitivity measure against the biased, clamped master ------------------


def test_feedback_and_sensitivity_measure_gpt_oss_experts_against_their_biased_clamped_master(tiny):
    """Every expert at 8 bits, every quantized row rechecked every step: 8-bit RTN weights with
    exact biases are a tiny relative error of the real expert; a reference without the biases or
    the clamp would differ from the served output by O(1)."""
    folder, _ = tiny("gpt_oss")
    options = {"bits": "16,8", "floor_bits": 8, "max_expert_error": None, "feedback_every": 1,
               "feedback_share": 1.0, "block_size": 4, **FAST}
    probe = create_calibrated("pagedweight", {"model": str(folder), **CPU32, "budget_bytes": ROOMY, **options})
    probe.start()
    stores, loaded = probe.paged.backend.stores, probe.loaded
    sensitivity = probe.paged.sensitivity
    budget = (loaded.dense_bytes + sum(s.nbytes(8) for s in stores.values()) + stores[(0, 0)].nbytes(16) // 2
              + 2 * LONGEST * loaded.kv_block_bytes(4))  # every expert at 8 bits, few can go to 16
    probe.stop()
    assert all(0 < row[8] < 1e-3 for row in sensitivity.values())
    got, steps, _, _ = generate("pagedweight", folder, budget_bytes=budget, **options)
    check_within(steps, budget, got)
    checked = [s.extras["feedback_error_max"] for s in steps if s.extras.get("feedback_checks")]
    assert checked and max(checked) < 1e-3
    assert max(s.extras["mean_bits"] for s in steps) < 16  # quantized experts served every step
