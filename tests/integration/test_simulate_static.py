"""--simulate for the static quantization engines (static-rtn, static-gptq, static-awq).

A simulated start quantizes nothing and writes no folder; its routed experts are meta-tensor
records shaped as the folder those options would produce reads back. The oracle is the
measured engine on the bundled model, which really quantizes into a folder and loads it:
the same weight bytes, per-expert bytes, record shapes and dtypes, KV capacity under one
--budget, and, replaying the measured run's routing, the same step decisions and bytes read.
At scale (config-only presets) the expert bytes are checked against hand-computed sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.base import EngineError, EngineRequest
from engines.registry import create_engine

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "engines" / "demo_model")
PRESETS = ROOT / "engines" / "sim" / "presets"
DECISIONS = ("num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "num_preempted",
             "cached_prompt_tokens", "experts_hit", "context_tokens", "weight_bytes_read")
# Few short calibration prompts: calibration changes the values, never the shapes or bytes.
FAST_CALIB = {"calib_samples": 4, "calib_len": 64}
# Dense weights (~1 MB float32) + experts (~0.3-0.6 MB) leave the KV blocks the rest.
BUDGET = 3 << 20


def _requests() -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", tuple((13 * i + j) % 1000 + 3 for j in range(20)), 5, ignore_eos=True)
            for i in range(4)]


def _steps(engine) -> list[dict]:
    for r in _requests():
        engine.add_request(r)
    rows = []
    while engine.has_unfinished():
        out = engine.step()
        rows.append({k: getattr(out, k) for k in DECISIONS})
    return rows


def _records(engine) -> dict[int, list]:
    """Per MoE layer: every tensor of its expert record as (shape, dtype), and its bytes."""
    backend = engine.experts
    out = {}
    for layer in backend.layers():
        rec = backend.weights(layer)
        tensors = [*rec.gate_up.tensors(), *rec.down.tensors()]
        out[layer] = [[(tuple(t.shape), t.dtype) for t in tensors], rec.nbytes(),
                      [backend.expert_bytes(layer, e) for e in range(backend.num_experts(layer))]]
    return out


def _biases(engine) -> list:
    """Each MoE layer's expert biases as (shape, dtype)."""
    recs = [engine.experts.weights(layer) for layer in engine.experts.layers()]
    return [(tuple(t.shape), t.dtype) for r in recs for t in (r.gate_up_bias, r.down_bias) if t is not None]


@pytest.mark.parametrize("name,options", [
    ("static-rtn", {"bits": 4}),  # group_size 128 is fitted to 64 (the demo's I = 64)
    pytest.param("static-rtn", {"bits": 8, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param("static-gptq", {"bits": 4}, marks=pytest.mark.slow),
    pytest.param("static-gptq", {"bits": 8, "group_size": 32}, marks=pytest.mark.slow),
    ("static-gptq", {"bits": 3, "group_size": 32, "sym": True, "act_order": True}),  # no zeros, a g_idx
    ("static-awq", {"bits": 4}),  # AWQ's own format
    pytest.param("static-awq", {"bits": 8, "group_size": 32}, marks=pytest.mark.slow),  # written as GPTQ
])
def test_simulated_start_holds_what_the_quantized_folder_loads(name, options, tmp_path):
    cache = tmp_path / "cache"
    trace = tmp_path / "routing.parquet"
    measured = create_engine(name, {"model": DEMO, "device": "cpu", "cache_dir": str(cache), "budget_bytes": BUDGET,
                                    "record_routing": str(trace), **FAST_CALIB, **options})
    measured.start()
    try:
        want, want_info, want_records = _steps(measured), measured.info(), _records(measured)
        want_notes = measured.notes()
    finally:
        measured.stop()
    folder = want_info.config["quantization"]["folder"]
    assert want_info.config["quantization"]["quantized_at_start"]

    sim_cache = tmp_path / "sim-cache"
    simulated = create_engine(name, {"model": DEMO, "simulate": "cpu", "cache_dir": str(sim_cache),
                                     "budget_bytes": BUDGET, "routing": f"replay:{trace}", **options})
    simulated.start()
    try:
        info, records = simulated.info(), _records(simulated)
        got = _steps(simulated)
        replay = simulated.simulation.routing.describe()
        notes = simulated.notes()
    finally:
        simulated.stop()
    assert not sim_cache.exists()  # nothing quantized, nothing written
    assert records == want_records
    assert info.weight_bytes == want_info.weight_bytes
    assert info.model_stats["bytes_per_expert"] == want_info.model_stats["bytes_per_expert"]
    assert info.kv_capacity_tokens == want_info.kv_capacity_tokens and info.kv_capacity_tokens > 0
    sim_q = {k: v for k, v in info.config["quantization"].items() if k not in ("folder", "quantized_at_start")}
    want_q = {k: v for k, v in want_info.config["quantization"].items() if k not in ("folder", "quantized_at_start")}
    assert sim_q == want_q and info.config["quantization"]["folder"] is None
    assert [n for n in want_notes if "group_size" in n][:1] == [n for n in notes if n.startswith("group_size")][:1]
    # The measured run's routing replayed: the same experts ran, so the same bytes were read.
    assert replay["replay_misses"] == 0 and replay["replay_hits"] > 0
    assert got == want
    assert sum(s["num_decode_tokens"] for s in got) == 4 * 4  # 5 new tokens: 1 from prefill, 4 decoded

    # The quantized folder itself, simulated (served as stored): the same records.
    again = create_engine(name, {"model": folder, "simulate": "cpu", "budget_bytes": BUDGET})
    again.start()
    try:
        assert _records(again) == want_records
        assert again.info().weight_bytes == want_info.weight_bytes
    finally:
        again.stop()


def test_mixtral_4bit_experts_sized_by_hand():
    """static-rtn, bits 4, Mixtral-8x7B (config-only preset) on an H100 profile.

    Mixtral-8x7B: D = hidden_size 4096, I = intermediate_size 14336, 8 experts, 32 MoE layers
    (the preset's config.json). RTN writes GPTQ's format; asymmetric (sym defaults False), so
    every row stores its zero codes; group_size 128 divides both D and I. As loaded, one expert is
      gate_up [2I, D]:  codes 2I * D * 4 bits;  scales fp16, 2I rows x D/128 groups;
                        zeros 4-bit codes of the D/128 = 32 groups packed in int32: 32*4/32 = 4 words/row
      down    [D, I]:   codes D * I * 4 bits;   scales fp16, D rows x I/128 = 112 groups;
                        zeros 112 codes * 4 bits = 448 bits = 14 int32 words per row
    """
    D, I, E, L = 4096, 14336, 8, 32
    gate_up = 2 * I * D * 4 // 8 + 2 * I * (D // 128) * 2 + 2 * I * 4 * 4
    down = D * I * 4 // 8 + D * (I // 128) * 2 + D * 14 * 4
    per_expert = gate_up + down
    assert per_expert == 91_521_024  # ~4.26 bits per weight: 4 + (16 + 4) / 128 ... plus word padding
    engine = create_engine("static-rtn", {"model": str(PRESETS / "mixtral-8x7b"), "bits": 4, "simulate": "h100-sxm"})
    engine.start()
    try:
        info = engine.info()
        assert info.device == "simulated h100-sxm"
        assert info.model_stats["bytes_per_expert"] == per_expert
        assert all(engine.experts.expert_bytes(layer, e) == per_expert for layer in range(L) for e in range(E))
        assert engine.experts.device_bytes() == L * E * per_expert
        assert info.weight_bytes == info.model_stats["dense_weight_bytes"] + 4096 * 32000 * 2 + L * E * per_expert
        engine.add_request(_requests()[0])
        out = engine.step()  # one prefill of 20 tokens: experts read at their packed size
        assert out.num_prefill_tokens == 20
        assert out.weight_bytes_read >= info.model_stats["dense_weight_bytes"] + L * 2 * per_expert
    finally:
        engine.stop()


def test_gpt_oss_mxfp4_preset_sized_as_stored():
    """A gpt-oss MXFP4 folder is served as stored (no --set bits). gpt-oss-20b: D = I = 2880,
    32 experts, 24 layers; MXFP4 holds per 32 inputs 16 bytes of E2M1 codes and one scale byte;
    the biases (gate_up 2I, down D) stay at the model dtype (bfloat16 on H100)."""
    D = I = 2880
    per_expert = 2 * I * (D // 32) * 17 + D * (I // 32) * 17 + (2 * I + D) * 2
    engine = create_engine("static-gptq", {"model": str(PRESETS / "gpt-oss-20b"), "simulate": "h100-sxm"})
    engine.start()
    try:
        assert engine.info().model_stats["bytes_per_expert"] == per_expert
        assert engine.info().config["quantization"]["format"] == "mxfp4"
    finally:
        engine.stop()
    with pytest.raises(EngineError, match="MXFP4 experts, served as stored"):
        create_engine("static-gptq", {"model": str(PRESETS / "gpt-oss-20b"), "bits": 4,
                                      "simulate": "h100-sxm"}).start()


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_other_architectures_match_their_quantized_folder(arch, checkpoints, tmp_path):
    """gpt-oss (per-expert biases kept at the model dtype, clamped SwiGLU) and DeepSeek-V3 (dense
    layers, a shared expert): a tiny random transformers model quantized for real, against the
    simulated start on the same folder."""
    src = str(checkpoints(arch))
    options = {"bits": 4, "group_size": 32}
    measured = create_engine("static-rtn", {"model": src, "device": "cpu", "cache_dir": str(tmp_path),
                                            **FAST_CALIB, **options})
    measured.start()
    try:
        want_info, want_records = measured.info(), _records(measured)
        biases = _biases(measured)
    finally:
        measured.stop()
    simulated = create_engine("static-rtn", {"model": src, "simulate": "cpu", **options})
    simulated.start()
    try:
        assert _biases(simulated) == biases and bool(biases) == (arch == "gpt_oss")
        clamps = {simulated.experts.weights(layer).clamp for layer in simulated.experts.layers()}
        assert clamps == {simulated.checkpoint.config.swiglu_clamp}
        assert _records(simulated) == want_records
        assert simulated.info().weight_bytes == want_info.weight_bytes
    finally:
        simulated.stop()
