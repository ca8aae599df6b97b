"""The server's Prometheus metrics, on a registry of its own (no global state).

Counters follow the engine's StepOutput: tokens, requests by outcome, bytes and transfers
across host<->device, steps, preemptions; gauges give the last step's running / waiting
requests, the requests the server holds (its queue), KV memory in use and, for engines
that change expert precision, the mean bits and the experts at each width. The server's own
counters: requests refused before the engine saw them (by HTTP status), requests that failed
after admission, engine restarts, and whether the engine is up.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest

from engines.base import EngineInfo, StepOutput


class ServerMetrics:
    def __init__(self, info: EngineInfo) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds
        r = self.registry
        self.prompt_tokens = Counter("pwbench_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("pwbench_generation_tokens", "Tokens generated", registry=r)
        self.prefill_tokens = Counter("pwbench_prefill_tokens", "Prompt tokens computed (not from the prefix cache)",
                                      registry=r)
        self.requests = Counter("pwbench_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.steps = Counter("pwbench_engine_steps", "Engine steps", registry=r)
        self.preemptions = Counter("pwbench_preemptions", "Sequences preempted", registry=r)
        self.bytes = Counter("pwbench_transfer_bytes", "Bytes moved between host and device", ["direction"], registry=r)
        self.transfers = Counter("pwbench_transfers", "Host<->device copies", ["direction"], registry=r)
        self.running = Gauge("pwbench_running_requests", "Requests running after the last step", registry=r)
        self.waiting = Gauge("pwbench_waiting_requests", "Requests waiting in the engine after the last step",
                             registry=r)
        self.queue = Gauge("pwbench_queue_length", "Requests the server holds (engine + inbox)", registry=r)
        self.kv_bytes = Gauge("pwbench_kv_cache_used_bytes", "KV memory held after the last step", registry=r)
        self.kv_blocks = Gauge("pwbench_kv_blocks_in_use", "KV blocks held after the last step", registry=r)
        self.weight_bytes = Gauge("pwbench_device_weight_bytes", "Device weight bytes after the last step",
                                  registry=r)
        self.mean_bits = Gauge("pwbench_expert_mean_bits", "Mean bit width of resident experts", registry=r)
        self.experts_at = Gauge("pwbench_experts_at_bits", "Resident experts at each bit width", ["bits"], registry=r)
        self.rejected = Counter("pwbench_rejected_requests", "Requests refused before the engine ran them, by HTTP "
                                "status (400 bad field, 401 key, 404 route/model, 413 body, 429 queue, 503 "
                                "unavailable)", ["status"], registry=r)
        self.failed = Counter("pwbench_failed_requests", "Requests that failed after admission (engine failure, "
                              "internal error)", registry=r)
        self.restarts = Counter("pwbench_engine_restarts", "Engine restarts after a failure", registry=r)
        self.engine_up = Gauge("pwbench_engine_up", "1 while the engine serves, 0 while it restarts, has failed or "
                               "the server drains", registry=r)
        self.engine_up.set(1)
        block = info.config.get("block_size") if info.config else None
        per_token = info.model_stats.get("kv_bytes_per_token") if info.model_stats else None
        self._block_bytes = block * per_token if block and per_token else None

    def observe_step(self, out: StepOutput, held: int) -> None:
        self.steps.inc()
        self.generation_tokens.inc(sum(len(o.new_token_ids) for o in out.outputs))
        self.prefill_tokens.inc(out.num_prefill_tokens)
        self.preemptions.inc(out.num_preempted)
        for o in out.outputs:
            if o.finished:
                self.requests.labels(o.finish_reason or "unknown").inc()
        for direction, n, count in (("h2d", out.h2d_bytes, out.h2d_transfers),
                                    ("d2h", out.d2h_bytes, out.d2h_transfers)):
            self.bytes.labels(direction).inc(n)
            self.transfers.labels(direction).inc(count)
        self.running.set(out.num_running)
        self.waiting.set(out.num_waiting)
        self.queue.set(held)
        self.kv_bytes.set(out.device_kv_bytes)
        if self._block_bytes:
            self.kv_blocks.set(round(out.device_kv_bytes / self._block_bytes))
        self.weight_bytes.set(out.device_weight_bytes)
        extras: dict[str, Any] = dict(out.extras)
        if "mean_bits" in extras:
            self.mean_bits.set(extras["mean_bits"])
        for key, value in extras.items():
            if key.startswith("experts_at_") and key.endswith("_bits"):
                self.experts_at.labels(key[len("experts_at_"):-len("_bits")]).set(value)

    def count_error(self, status: int) -> None:
        """An error answer: a 5xx other than 503 is a failure, anything else a refusal."""
        if status >= 500 and status != 503:
            self.failed.inc()
        else:
            self.rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
