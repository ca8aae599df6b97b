"""gpt-oss MXFP4 served as stored by the engines that move experts: offload (host tier and
slots hold the 4-bit blocks, scale bytes and biases), pagedweight and full (the checkpoint's
MXFP4 is an expert's top width, 3 and 2 bits quantized from its dequantized values).

Oracles: transformers' own MXFP4 loader (GptOssForCausalLM with Mxfp4Config(dequantize=True))
for the greedy tokens, `convert_moe_packed_tensors` for the served weights, byte counts
computed by hand from the shapes (blocks rows x cols / 2, one scale byte per 32 values, float32
biases), and the budget itself after every step. The tiny MXFP4 folder is built as in
test_mxfp4.py (quantizer written from the OCP definition).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_runs import random_requests
from safetensors.torch import load_file, save_file
from tiny_models import ARCH_KWARGS, CPU32, build_hf_model

from engines.base import EngineError
from engines.pagedweight.engine import parse_bits
from engines.pagedweight.formats import MXFP4, Mxfp4Store, Mxfp4Version
from engines.registry import create_engine
from harness.offline import run_offline

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
NEW = 8
REQS = random_requests(257, n=3, new=NEW, seed=5, lo=3, hi=30)
ROOMY = 64 << 20
FAST = {"calib_prompts": 2, "block_size": 4}
KW = ARCH_KWARGS["gpt_oss"]
D, I, E, L = KW["hidden_size"], KW["intermediate_size"], KW["num_local_experts"], KW["num_hidden_layers"]
# One expert as stored: gate_up [2I, D] and down [D, I] as 4-bit codes (2 per byte) and one E8M0
# byte per 32 inputs, plus the float32 biases [2I] and [D].
MXFP4_EXPERT = (2 * I * D // 2 + 2 * I * D // 32) + (D * I // 2 + D * I // 32) + 4 * (2 * I + D)
DENSE_EXPERT = 4 * (3 * D * I + 2 * I + D)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] float -> (blocks [..., C/32, 16] uint8, scales [..., C/32] uint8)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    codes = (groups / torch.exp2(exponent)[..., None])[..., None].sub(E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 folder, the packed tensors it holds, request id -> transformers' greedy tokens)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    folder = tmp_path_factory.mktemp("mxfp4") / "gpt_oss-mxfp4"
    model = build_hf_model("gpt_oss", seed=3)
    model.save_pretrained(folder)
    packed = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)  # [E, in, out]; MXFP4 rows are [E, out, in]
            prefix = f"model.layers.{i}.mlp.experts.{name}"
            packed[prefix + "_blocks"], packed[prefix + "_scales"] = quantize_mxfp4(param.detach().transpose(1, 2))
    state = {k: v for k, v in load_file(folder / "model.safetensors").items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    oracle = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32).eval()
    with torch.inference_mode():
        want = {r.request_id: oracle.generate(torch.tensor([r.prompt_ids]), max_new_tokens=NEW, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)[0, len(r.prompt_ids):].tolist()
                for r in REQS}
    return folder, packed, want


def checkpoint_weights(packed: dict, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' dequantization of one expert -> (gate_up [2I, D] gate rows first, down [D, I])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    p = f"model.layers.{layer}.mlp.experts."
    gate_up = convert_moe_packed_tensors(packed[p + "gate_up_proj_blocks"], packed[p + "gate_up_proj_scales"],
                                         dtype=torch.float32)[expert]  # [D, 2I], gate/up columns alternate
    down = convert_moe_packed_tensors(packed[p + "down_proj_blocks"], packed[p + "down_proj_scales"],
                                      dtype=torch.float32)[expert]  # [I, D]
    return torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), -1).T, down.T


def run(name: str, folder, **options):
    """(request id -> tokens, step outputs, info, the stopped engine with `dense_bytes` set)."""
    engine = create_engine(name, {"model": str(folder), **CPU32, **options})
    engine.start()
    steps = []
    try:
        done = run_offline(engine, REQS, on_step=steps.append)
        info = engine.info()
        engine.dense_bytes = engine.loaded.dense_bytes
    finally:
        engine.stop()
    return {rid: c.output_ids for rid, c in done.items()}, steps, info, engine


def check_within(steps, budget: int, got: dict) -> None:
    assert sorted(got) == sorted(r.request_id for r in REQS) and all(len(t) == NEW for t in got.values())
    for s in steps:
        assert s.device_weight_bytes + s.device_kv_bytes <= budget


# --- offload ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 2])
def test_offload_serves_mxfp4_by_default_and_gives_transformers_tokens(slots, mxfp4):
    """The slots hold and the copies move the stored bytes: device and h2d bytes are the 4-bit
    counts, and every expert in a slot dequantizes to transformers' reading bit for bit."""
    folder, packed, want = mxfp4
    engine = create_engine("offload", {"model": str(folder), **CPU32, "experts_per_layer": slots, "block_size": 4})
    engine.start()
    steps = []
    try:
        done = run_offline(engine, REQS, on_step=steps.append)
        info = engine.info()
        dense = engine.loaded.dense_bytes
        backend = engine.experts
        assert backend.device_bytes() == L * slots * MXFP4_EXPERT
        for layer in backend.layers():
            for e, slot in backend.caches[layer].slot_of.items():
                parts = {n: t[slot] for n, t in backend.slot_buffers[layer].parts.items()}
                served = Mxfp4Version("bitplanes", MXFP4, parts, (I, D), 32).weights(torch.float32)
                for got, ref in zip(served, checkpoint_weights(packed, layer, e)):
                    assert torch.equal(got, ref)
    finally:
        engine.stop()
    assert {rid: c.output_ids for rid, c in done.items()} == want
    misses = sum(s.extras["expert_cache_misses"] for s in steps)
    assert misses > 0 and sum(s.h2d_bytes for s in steps) == misses * MXFP4_EXPERT
    assert all(s.device_weight_bytes == info.weight_bytes for s in steps)
    assert info.weight_bytes == dense + L * slots * MXFP4_EXPERT
    assert info.model_stats["bytes_per_expert"] == MXFP4_EXPERT
    assert info.config["expert_format"] == "mxfp4"


def test_offload_dense_on_an_mxfp4_folder_and_refusals(mxfp4, checkpoints):
    folder, _, want = mxfp4
    got, steps, info, _ = run("offload", folder, experts_per_layer=2, expert_format="dense", block_size=4)
    assert got == want and info.model_stats["bytes_per_expert"] == DENSE_EXPERT
    assert info.config["expert_format"] == "dense"
    plain = checkpoints("gpt_oss")
    with pytest.raises(EngineError, match=r"expert_format=mxfp4 serves gpt-oss folders .* use expert_format=dense"):
        create_engine("offload", {"model": str(plain), **CPU32, "experts_per_layer": 1,
                                  "expert_format": "mxfp4"}).start()
    with pytest.raises(EngineError, match=r"expert_format must be one of dense, mxfp4"):
        create_engine("offload", {"model": str(folder), **CPU32, "experts_per_layer": 1,
                                  "expert_format": "fp4"}).start()


def test_offload_budget_counts_mxfp4_expert_bytes(mxfp4):
    """K from the budget uses the MXFP4 expert bytes: a budget of dense + KV reserve + 3
    experts per layer in MXFP4 (far below one dense expert per layer x 3) gives K = 3."""
    folder, _, want = mxfp4
    probe = create_engine("offload", {"model": str(folder), **CPU32, "experts_per_layer": 1, "block_size": 4})
    probe.start()
    dense, block = probe.loaded.dense_bytes, probe.loaded.kv_block_bytes(4)
    probe.stop()
    reserve = 64 * block
    budget = dense + reserve + 3 * L * MXFP4_EXPERT
    got, steps, info, _ = run("offload", folder, budget_bytes=budget, kv_reserve_bytes=reserve, block_size=4)
    assert info.model_stats["expert_slots_per_layer"] == 3 and 3 * L * MXFP4_EXPERT < L * DENSE_EXPERT
    check_within(steps, budget, got)
    assert got == want


# --- pagedweight and full ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,options", [("pagedweight", {}), ("pagedweight", {"representation": "requantize"}),
                                          ("full", {})])
def test_paged_engines_hold_every_expert_at_mxfp4_and_give_transformers_tokens(name, options, mxfp4):
    folder, packed, want = mxfp4
    got, steps, info, engine = run(name, folder, budget_bytes=ROOMY, **FAST, **options)
    assert got == want
    assert info.config["bits"] == "mxfp4,3,2"
    backend = engine.paged.backend
    held = {k: backend.bits(k) for k in backend.stores}
    assert set(held.values()) == {MXFP4} and len(held) == L * E
    staging = backend.staging_bytes  # full: floor_bits 0 keeps room to fetch an expert on demand
    assert all(s.extras["mean_bits"] == 4.25 and s.extras["experts_at_mxfp4_bits"] == L * E for s in steps)
    assert all(s.device_weight_bytes == engine.dense_bytes + L * E * MXFP4_EXPERT + staging for s in steps)
    assert engine.ledger.total["h2d:expert_pages"] == L * E * MXFP4_EXPERT  # loaded once, as stored
    assert sum(s.h2d_bytes for s in steps) == 0
    assert all(r["bits_mean"] == 4.25 and r["bits_min"] == 4.25 for r in engine.tables()["request_bits"])
    assert info.model_stats["bytes_per_expert"] == MXFP4_EXPERT


def test_default_engine_full_with_no_budget_serves_an_mxfp4_folder(mxfp4):
    folder, _, want = mxfp4
    got, _, info, _ = run("full", folder, calib_prompts=2)
    assert got == want and info.config["bits"] == "mxfp4,3,2"


def test_sixteen_bits_only_when_asked_and_then_the_same_values(mxfp4):
    """bits naming 16 adds the dequantized MXFP4 as a version: its values are the checkpoint's,
    and at equal (zero) error the arbiter holds the cheaper MXFP4."""
    folder, packed, want = mxfp4
    got, _, info, engine = run("pagedweight", folder, budget_bytes=ROOMY, bits="16,mxfp4,2", **FAST)
    assert got == want and info.config["bits"] == "16,mxfp4,2"
    stores = engine.paged.backend.stores
    assert {engine.paged.backend.bits(k) for k in stores} == {MXFP4}
    for (layer, e), store in stores.items():
        assert store.exact_bits == {16, MXFP4} and store.nbytes(16) == DENSE_EXPERT
        for got_w, ref in zip(store.version(16).weights(torch.float32), checkpoint_weights(packed, layer, e)):
            assert torch.equal(got_w, ref)


def test_paged_served_mxfp4_weights_are_the_checkpoints(mxfp4):
    """What the device holds is the stored bytes: dequantized, transformers' values bit for bit."""
    folder, packed, _ = mxfp4
    engine = create_engine("pagedweight", {"model": str(folder), **CPU32, "budget_bytes": ROOMY, **FAST})
    engine.start()
    try:
        backend = engine.paged.backend
        for (layer, e), h in backend.held.items():
            served = backend.stores[(layer, e)].version(h.bits, h.parts).weights(torch.float32)
            for got, ref in zip(served, checkpoint_weights(packed, layer, e)):
                assert torch.equal(got, ref)
            assert h.nbytes == MXFP4_EXPERT
    finally:
        engine.stop()


@pytest.mark.parametrize("name,options", [("pagedweight", {"max_expert_error": None}),
                                          ("full", {"max_expert_error": None})])
def test_paged_engines_below_mxfp4_keep_their_budget_and_serve_every_request(name, options, mxfp4):
    """pagedweight (floor 2 bits): room for every expert at 2 bits and a third of the way up to
    MXFP4 beside the longest request's KV, so experts are demoted to 3 and 2 bits; full (floor
    0): a third of the experts in MXFP4 above its least budget, so experts also leave the device
    and are fetched on demand."""
    folder, _, _ = mxfp4
    options = {**options, **FAST}
    probe = create_engine(name, {"model": str(folder), **CPU32, "budget_bytes": ROOMY, **options})
    probe.start()
    dense, block = probe.loaded.dense_bytes, probe.loaded.kv_block_bytes(4)
    lowest = sum(n for _, n in probe.budget.parts())
    at2 = sum(s.nbytes(2) for s in probe.paged.backend.stores.values())
    probe.stop()
    top = L * E * MXFP4_EXPERT
    longest = -(-(max(len(r.prompt_ids) for r in REQS) + NEW) // 4)
    budget = (dense + at2 + (top - at2) // 3 + longest * block if name == "pagedweight" else lowest + top // 3)
    got, steps, _, engine = run(name, folder, budget_bytes=budget, **options)
    check_within(steps, budget, got)
    assert min(s.extras["mean_bits"] for s in steps) < 4.25
    assert min(r["bits_min"] for r in engine.tables()["request_bits"]) in (2, 3)  # served below MXFP4
    lower = sum(s.extras["experts_at_3_bits"] + s.extras["experts_at_2_bits"] for s in steps)
    assert lower > 0 and sum(s.extras["experts_at_mxfp4_bits"] for s in steps) > 0
    if name == "full":
        assert sum(s.extras["on_demand_fetches"] for s in steps) > 0


# --- stores and options --------------------------------------------------------------------------


def test_mxfp4_store_parts_and_moves():
    """The MXFP4 version is the stored parts; 3 and 2 bits share only the biases with it (so a
    demotion copies their planes); no dense master stays in the host tier."""
    from engines.runtime.mxfp4 import Mxfp4Expert, Mxfp4Weight

    g = torch.Generator().manual_seed(0)
    gu, dn = quantize_mxfp4(torch.randn(2 * I, D, generator=g)), quantize_mxfp4(torch.randn(D, I, generator=g))
    expert = Mxfp4Expert(Mxfp4Weight(*gu), Mxfp4Weight(*dn), torch.randn(2 * I, generator=g),
                         torch.randn(D, generator=g), (7.0, 1.702))
    store = Mxfp4Store(expert, (MXFP4, 3, 2), "bitplanes")
    assert store.nbytes(MXFP4) == MXFP4_EXPERT and store.exact_bits == {MXFP4}
    planes = lambda n: sum(rows * cols // 8 * n for rows, cols in ((2 * I, D), (D, I)))  # noqa: E731
    shared = 4 * (2 * I * D // 32 + D * I // 32) + (2 * I * D // 32 + D * I // 32)  # float32 scales, uint8 zeros
    assert store.transfer_bytes(MXFP4, 3) == planes(3) + shared  # biases stay
    assert store.transfer_bytes(3, 2) == 0 and store.freed_bytes(MXFP4, 3) == MXFP4_EXPERT - 4 * (2 * I + D)
    assert store.host_bytes() == MXFP4_EXPERT + planes(3) + shared
    x = torch.randn(5, D, generator=g)
    assert torch.equal(store.version(MXFP4).forward(x), store.reference(x))


def test_bits_name_mxfp4_only_on_mxfp4_checkpoints():
    assert parse_bits(None, 2, mxfp4=True) == (MXFP4, 3, 2)
    assert parse_bits("16,mxfp4,2", 2, mxfp4=True) == (16, MXFP4, 2)
    assert parse_bits(None, 2) == (16, 8, 4, 3, 2)
    with pytest.raises(EngineError, match=r"on an MXFP4 checkpoint bits must include mxfp4"):
        parse_bits("8,3,2", 2, mxfp4=True)
    with pytest.raises(EngineError, match=r"mxfp4, the width of gpt-oss MXFP4 checkpoints only"):
        parse_bits("16,mxfp4", 2)
