"""The cost model's inputs from a loaded model and a machine: ModelShape and Hardware.

Peaks come from the engine's options when given, else from `pwbench hw`'s cache (hw.json in
the pwbench cache folder, written by harness/hw.py; read here so engines need no harness),
else from a stated assumption. On a CPU run host and device are the same processor.
"""

from __future__ import annotations

from typing import Any

from engines.common.peaks import cached_peaks, cpu_model
from engines.moegen.cost import Hardware, ModelShape

# Used only when neither options nor a `pwbench hw` measurement give the peaks; said in the plan.
ASSUMED_CPU = {"memory_bandwidth_bytes_per_s": 20e9, "matmul_flops_per_s": 100e9}


def device_name(device: Any) -> str:
    """The name `pwbench hw` files a device's measurements under."""
    if device.type == "cuda":
        import torch  # noqa: PLC0415

        return torch.cuda.get_device_name(device)
    return cpu_model()


def hardware(device_name: str, on_cpu: bool, link_bytes_per_s: float | None, peaks: dict[str, Any] | None = None,
             host_peaks: dict[str, Any] | None = None, op_overhead_s: float | None = None) -> Hardware:
    """Hardware for the cost model. `peaks` (memory_bandwidth_bytes_per_s, matmul_flops_per_s):
    given, else measured for `device_name`, else assumed; `host_peaks` likewise for the host CPU
    (the same as `peaks` on a CPU run). The per-call overhead: given, else `pwbench hw`'s."""
    source = "given"
    if not peaks:
        peaks = cached_peaks().get(device_name)
        source = f"measured by pwbench hw at {peaks.get('measured_at')}" if peaks else \
            "assumed (run `pwbench hw` to measure this machine)"
        peaks = peaks or ASSUMED_CPU
    host = peaks if on_cpu else (host_peaks or ASSUMED_CPU)
    if op_overhead_s is None:
        op_overhead_s = float(peaks.get("op_overhead_s", 0.0))
    if not on_cpu and link_bytes_per_s is None:
        link_bytes_per_s = peaks.get("h2d_bytes_per_s")
    return Hardware(
        device_bytes_per_s=float(peaks["memory_bandwidth_bytes_per_s"]),
        device_flops_per_s=float(peaks["matmul_flops_per_s"]),
        host_bytes_per_s=float(host["memory_bandwidth_bytes_per_s"]),
        host_flops_per_s=float(host["matmul_flops_per_s"]),
        link_bytes_per_s=link_bytes_per_s, op_overhead_s=op_overhead_s, source=source,
        weight_bytes_per_s=peaks.get("skinny_matmul_bytes_per_s"), shared_processor=on_cpu,
        flops_at_rows=tuple((int(r), float(f)) for r, f in (peaks.get("matmul_flops_at_rows") or {}).items()),
        sample_bytes_per_s=peaks.get("argmax_bytes_per_s"),
        elementwise_bytes_per_s=peaks.get("elementwise_bytes_per_s"),
        elementwise_at_tokens=tuple((int(t), float(r))
                                    for t, r in (peaks.get("elementwise_bytes_per_s_at_tokens") or {}).items()),
        attention_bytes_per_s=peaks.get("decode_attention_bytes_per_s"),
        host_attention_bytes_per_s=host.get("decode_attention_bytes_per_s"),
        prefill_attention_flops_per_s=peaks.get("prefill_attention_flops_per_s"),
        host_prefill_attention_flops_per_s=host.get("prefill_attention_flops_per_s"),
    )


def model_shape(mc: Any, dtype_bytes: int) -> ModelShape:
    """ModelShape of a runtime ModelConfig `mc` at `dtype_bytes` per weight, from the config
    alone (no weights read, so `pwbench plan` sizes a large model on a small machine);
    tests/integration/test_moegen.py checks these bytes against the loaded weights."""
    D, V, L, q, kv = mc.hidden_size, mc.vocab_size, mc.num_layers, mc.q_size, mc.kv_size
    norms = {"none": 0, "head": 2 * mc.head_dim, "full": q + kv}[mc.qk_norm]
    attn = 2 * D * q + 2 * D * kv + (q + 2 * kv if mc.qkv_bias else 0) + (D if mc.o_bias else 0) + norms
    gate = D if mc.shared_expert_gated else 0
    shared = (3 * D * mc.shared_expert_intermediate_size + gate) if mc.shared_expert_intermediate_size else 0
    bias = mc.num_experts if mc.router == "sigmoid_groups" else 0  # the routing correction bias
    layers = sum(attn + 2 * D + (mc.num_experts * D + bias + shared if moe else 3 * D * mc.dense_intermediate_size)
                 for moe in mc.moe_layers)
    head = V * D + D  # LM head and the final norm
    dense = (V * D + layers + D + (0 if mc.tie_word_embeddings else V * D)) * dtype_bytes
    return ModelShape(
        layers=L, moe_layers=sum(mc.moe_layers), experts=mc.num_experts, top_k=mc.top_k,
        hidden=D, q_size=q, kv_size=kv, heads=mc.num_heads, head_dim=mc.head_dim,
        intermediate=mc.moe_intermediate_size, vocab=V, dense_bytes=dense, layer_dense_bytes=layers * dtype_bytes // L,
        head_bytes=head * dtype_bytes, expert_bytes=3 * D * mc.moe_intermediate_size * dtype_bytes,
        kv_bytes_per_token=2 * L * kv * dtype_bytes, dtype_bytes=dtype_bytes,
    )
