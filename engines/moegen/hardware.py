"""The cost model's Hardware from options, `pwbench hw` or assumptions (ModelShape: runtime/shape.py).

Peaks come from the engine's options when given, else from `pwbench hw`'s cache (hw.json in
the pwbench cache folder, written by harness/hw.py; read here so engines need no harness),
else from a stated assumption. On a CPU run host and device are the same processor.
"""

from __future__ import annotations

from typing import Any

from engines.common.peaks import cached_peaks, cpu_model
from engines.moegen.cost import Hardware

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
