"""Efficiency metrics (bytes read, FLOPs, MBU/MFU, link use), where the peaks come from, and
queue time, on small cases worked out by hand in the comments."""

from __future__ import annotations

import json

import pytest

from harness.hw import DATASHEET, datasheet_for, peaks_for, save_cached
from harness.metrics import efficiency, request_times, summarize, summarize_requests

MODEL = {"dense_weight_bytes": 1000, "bytes_per_expert": 100, "kv_bytes_per_token": 10, "active_params_per_token": 500}
PEAKS = {"memory_bandwidth_bytes_per_s": 7000.0, "matmul_flops_per_s": 12000.0, "h2d_bytes_per_s": 1000.0,
         "source": "hand"}


def step(duration, prefill, decode, experts, context, h2d=0):
    return {"duration_s": duration, "prefill_tokens": prefill, "decode_tokens": decode, "experts_hit": experts,
            "context_tokens": context, "h2d_bytes": h2d, "d2h_bytes": 0, "h2d_transfers": 0, "d2h_transfers": 0,
            "preempted": 0}


STEPS = [
    step(1.0, 64, 1, 8, 65, h2d=400),  # has prefill: not a decode step, but its time and bytes count for link use
    step(0.5, 0, 2, 3, 20, h2d=100),  # read 1000 + 3 x 100 + 20 x 10 = 1500 B; 2 x 500 x 2 = 2000 FLOP
    step(1.5, 0, 4, 5, 50),  # read 1000 + 5 x 100 + 50 x 10 = 2000 B; 2 x 500 x 4 = 4000 FLOP
    step(0.25, 0, 0, 0, 0),  # nothing decoded: not a decode step
]


def test_efficiency_by_hand():
    e = efficiency(STEPS, MODEL, PEAKS)
    # decode-only steps: 3500 B and 6000 FLOP in 2.0 s
    assert e["decode_bandwidth_bytes_per_s"] == pytest.approx(1750.0)
    assert e["decode_flops_per_s"] == pytest.approx(3000.0)
    assert e["mbu"] == pytest.approx(1750 / 7000)  # 0.25
    assert e["mfu"] == pytest.approx(3000 / 12000)  # 0.25
    # link: 500 B host->device over all 3.25 s of steps, against 1000 B/s
    assert e["h2d_link_utilization"] == pytest.approx(500 / 3.25 / 1000)
    assert e["peaks_source"] == "hand"


def test_efficiency_without_peaks_decode_steps_or_model():
    # Peaks without a FLOP rate: MBU only; no peaks at all: the rates, no ratios.
    e = efficiency(STEPS, MODEL, {"memory_bandwidth_bytes_per_s": 3500.0, "source": "s"})
    assert e["mbu"] == pytest.approx(0.5) and "mfu" not in e and "h2d_link_utilization" not in e
    e = efficiency(STEPS, MODEL, {"source": "none"})
    assert set(e) == {"peaks_source", "decode_bandwidth_bytes_per_s", "decode_flops_per_s"}
    # Only a prefill step, or an engine without model stats (dummy): just the source.
    assert efficiency(STEPS[:1], MODEL, PEAKS) == {"peaks_source": "hand"}
    assert efficiency(STEPS, {}, PEAKS) == {"peaks_source": "hand"}


def test_efficiency_goes_into_the_summary():
    rows = [{"arrival_s": 0.0, "sent_s": 0.0, "started_s": 1.0, "finish_s": 3.25, "token_times_s": [1.0, 1.5, 3.0],
             "prompt_tokens": 64, "output_tokens": 3, "error": None}]
    s = summarize(rows, STEPS, {"ttft_ms": 2000}, MODEL, PEAKS)
    assert s["efficiency"]["mbu"] == pytest.approx(0.25) and s["accuracy"] == {}
    # prefill: 64 tokens in the 1.0 s step; decode-only steps: 6 tokens in 2.0 s
    assert s["engine"]["prefill_tokens_per_s"] == pytest.approx(64.0)
    assert s["engine"]["decode_tokens_per_s"] == pytest.approx(3.0)
    assert s["engine"]["h2d_bytes_per_output_token"] == pytest.approx(500 / 3)


def test_queue_time_by_hand():
    # queue = started_s - arrival_s: 10, 30 and 70 ms. A request not started yet and a failed
    # one have none. p50 = 30; p90 at rank (3 - 1) x 0.9 = 1.8: 30 + 0.8 x (70 - 30) = 62.
    def row(rid, arrival, started, finish, error=None):
        return {"request_id": rid, "arrival_s": arrival, "sent_s": arrival, "started_s": started, "finish_s": finish,
                "token_times_s": [started, finish] if started is not None else [], "prompt_tokens": 4,
                "output_tokens": 2 if started is not None else 0, "error": error}

    rows = [row("a", 0.0, 0.010, 0.1), row("b", 0.5, 0.530, 0.6), row("c", 1.0, 1.070, 1.2),
            row("d", 1.1, None, None, "not finished"), row("e", 1.2, 1.25, None, "interrupted")]
    assert request_times(rows[1]).queue_s == pytest.approx(0.030)
    assert request_times(rows[3]).queue_s is None
    assert request_times({**rows[0], "started_s": float("nan")}).queue_s is None  # a null from parquet
    q = summarize_requests(rows, {"ttft_ms": 1e9})["queue_ms"]
    assert q["mean"] == pytest.approx((10 + 30 + 70) / 3)
    assert q["p50"] == pytest.approx(30.0)
    assert q["p90"] == pytest.approx(62.0)
    assert q["p99"] == pytest.approx(30 + 0.98 * 40)  # rank 1.98


def test_peaks_source_measured_datasheet_or_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))
    # Nothing cached: the datasheet by whole-word model name, else none.
    p = peaks_for("NVIDIA H200")
    assert p["source"] == "datasheet (H200)" and p["memory_bandwidth_bytes_per_s"] == 4.8e12
    assert peaks_for("NVIDIA H100 80GB HBM3")["source"] == "datasheet (H100)"
    assert peaks_for("NVIDIA A100-SXM4-80GB")["matmul_flops_per_s"] == 312e12
    assert peaks_for("NVIDIA A10G")["source"] == "datasheet (A10G)"
    assert peaks_for("NVIDIA RTX 6000 Ada Generation")["source"] == "datasheet (RTX 6000 Ada)"
    assert datasheet_for("NVIDIA L4") == ("L4", DATASHEET["L4"])
    for unknown in ("NVIDIA L40S", "NVIDIA A1000", "AMD EPYC 7B13", "", None):
        assert datasheet_for(unknown) is None, unknown
        assert peaks_for(unknown) == {"source": "none: run `pwbench hw` on this machine to measure peaks"}
    # A measured entry (what `pwbench hw` caches) wins over the datasheet, for that name only.
    save_cached({"device_name": "NVIDIA H200", "memory_bandwidth_bytes_per_s": 4.1e12, "matmul_flops_per_s": 7.9e14,
                 "measured_at": "2030-01-02T03:04:05"})
    save_cached({"device_name": "Some CPU", "memory_bandwidth_bytes_per_s": 2e10, "measured_at": "then"})
    p = peaks_for("NVIDIA H200")
    assert p["source"] == "measured by pwbench hw at 2030-01-02T03:04:05"
    assert p["memory_bandwidth_bytes_per_s"] == 4.1e12
    assert peaks_for("NVIDIA H100")["source"] == "datasheet (H100)"
    assert set(json.loads((tmp_path / "cache" / "hw.json").read_text())) == {"NVIDIA H200", "Some CPU"}
    # ... and feeds MBU: 1750 B/s against 2e10 B/s.
    assert efficiency(STEPS, MODEL, peaks_for("Some CPU"))["mbu"] == pytest.approx(1750 / 2e10)


def test_goodput_by_hand():
    # SLO: TTFT <= 125 ms, TPOT <= 31.25 ms, E2E <= 375 ms (binary fractions, so "at the limit"
    # is exact); the run spans 2.0 s (first arrival 0 to last finish).
    #   a: TTFT 125 and TPOT 250 / 8 = 31.25 and E2E 375, all at the limit: meets
    #   b: one token: TTFT 62.5, no TPOT (cannot violate it), E2E 62.5: meets
    #   c: TTFT 250: misses;  d: TPOT 62.5: misses;  e: E2E 500: misses (TTFT 15.6, TPOT 31.25)
    #   f: failed: not completed, not counted
    def row(arrival, times, finish, error=None):
        return {"arrival_s": arrival, "sent_s": arrival, "started_s": times[0] if times else None, "finish_s": finish,
                "token_times_s": times, "prompt_tokens": 1, "output_tokens": len(times), "error": error}

    a = row(0.0, [0.125 + 0.03125 * i for i in range(9)], 0.375)
    b = row(1.0, [1.0625], 1.0625)
    c = row(1.0, [1.25, 1.28125], 1.28125)
    d = row(1.0, [1.0625, 1.125], 1.125)
    e = row(1.5, [1.515625 + 0.03125 * i for i in range(16)], 2.0)
    f = row(1.9, [], None, "not finished")
    s = summarize_requests([a, b, c, d, e, f], {"ttft_ms": 125, "tpot_ms": 31.25, "e2e_ms": 375})
    assert s["completed"] == 5 and s["failed"] == 1 and s["duration_s"] == 2.0
    assert s["goodput_requests_per_s"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["requests_per_s"] == pytest.approx(5 / 2.0)
    # Each target alone: TTFT keeps a, b, d, e; TPOT keeps a, b, c, e; E2E keeps a, b, c, d.
    for target in ({"ttft_ms": 125}, {"tpot_ms": 31.25}, {"e2e_ms": 375}):
        assert summarize_requests([a, b, c, d, e, f], target)["slo_attainment"] == pytest.approx(4 / 5), target


def test_expert_precision_by_hand():
    from harness.metrics import expert_precision

    rows = [
        {"duration_s": 1.0, "x_mean_bits": 16.0, "x_promotions": 0, "x_demotions": 0, "x_move_bytes": 0,
         "x_feedback_checks": 0, "x_fallbacks": 0},
        {"duration_s": 2.0, "x_mean_bits": 7.0, "x_promotions": 0, "x_demotions": 3, "x_move_bytes": 300,
         "x_feedback_checks": 1, "x_feedback_error_max": 0.02, "x_feedback_rows": 10, "x_feedback_s": 0.1,
         "x_feedback_bytes": 5120, "x_fallbacks": 0},
        {"duration_s": 1.0, "x_mean_bits": 10.0, "x_promotions": 2, "x_demotions": 0, "x_move_bytes": 700,
         "x_feedback_checks": 1, "x_feedback_error_max": 0.3, "x_feedback_rows": 6, "x_feedback_s": 0.3,
         "x_feedback_bytes": 3072, "x_fallbacks": 1},
    ]
    got = expert_precision(rows)
    # mean bits (16 + 7 + 10) / 3 = 11; feedback 0.4 s of 4 s busy = 10%
    assert got == {"mean_bits": 11.0, "min_bits": 7.0, "max_bits": 16.0, "first_bits": 16.0, "last_bits": 10.0,
                   "promotions": 2, "demotions": 3, "move_bytes": 1000, "feedback_checks": 2,
                   "feedback_error_max": 0.3, "fallbacks": 1, "feedback_rows": 16,
                   "feedback_s": pytest.approx(0.4), "feedback_bytes": 8192,
                   "feedback_share_of_busy": pytest.approx(0.1)}
    assert expert_precision([{"duration_s": 1.0}]) == {}  # engines that keep no bit widths
