"""A real engine (`moe` on a tiny Mixtral, CPU, float32) through `pwbench run`, with every
steps.parquet series checked end to end against what happened, computed here:

- an offline batch whose steps are known from the documented schedule (all prompts in one
  prefill step, then one decode token per sequence per step): prefill/decode/context tokens
  per step exactly, and experts hit per step against transformers' own router run on the same
  tokens (the prompts rebuilt from run.json, the outputs from requests.parquet);
- rag_long with the KV cache forced small: preemptions happen and are counted, no step attends
  more tokens than the cache holds, the recomputed tokens show in the token counts, and the
  outputs still are transformers' greedy tokens.
Both on the CPU, where nothing crosses a bus: 0 bytes and 0 transfers every step; a
CUDA-marked variant checks the bytes a GPU step moves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from engines.runtime import cpu_attention, gemm
from harness.results import read_run

EPS = 1e-5  # router logits closer than this count as a tie (either expert may run)


def run_cli(out: Path, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(out.parent / "cache")}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--engine", "moe", "--device", "cpu",
                           "--dtype", "float32", "--warmup", "0", "--no-quality", "--output", str(out), "--quiet",
                           *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return read_run(out)


def prompts_of(run: dict) -> dict[str, tuple[int, ...]]:
    """The run's prompts, rebuilt from run.json's workload config and engine info."""
    from workloads.registry import ModelTarget, WorkloadSpec, build_workload

    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in run["config"]["workload"].items()}
    eng = run["engine"]
    workload = build_workload(WorkloadSpec(**cfg), ModelTarget(eng["vocab_size"], eng["max_model_len"],
                                                              tuple(eng["eos_token_ids"])))
    return {r.request_id: tuple(r.prompt_ids) for r in workload.requests}


class HFRouter:
    """transformers' Mixtral on the same tokens: greedy logits and each layer's router choice."""

    def __init__(self, folder: Path) -> None:
        from transformers import MixtralForCausalLM

        self.model = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.top_k = self.model.config.num_experts_per_tok
        self._logits: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda mod, inp, out: self._logits.append(out[0].detach()))

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, list[list[tuple[set[int], set[int]]]]]:
        """(logits [T, V], per position per layer (experts surely chosen, experts possibly chosen))."""
        self._logits = []
        logits = self.model(torch.tensor([ids])).logits[0]
        k = self.top_k
        routes = []
        for pos in range(len(ids)):
            per_layer = []
            for router in self._logits:
                row = router[pos]
                order = torch.argsort(row, descending=True).tolist()
                kth, next_ = row[order[k - 1]].item(), row[order[k]].item()
                sure = {e for e in order[:k] if row[e].item() > next_ + EPS}
                maybe = {e for e in order if row[e].item() >= kth - EPS}
                per_layer.append((sure, maybe))
            routes.append(per_layer)
        return logits, routes


def check_greedy(logits: torch.Tensor, prompt_len: int, output_ids: list[int]) -> None:
    """Each output token is transformers' argmax given the tokens before it (ties excepted)."""
    rows = logits[prompt_len - 1 : prompt_len - 1 + len(output_ids)]
    top2 = torch.topk(rows, 2, dim=-1)
    for i, token in enumerate(output_ids):
        if token != top2.indices[i, 0].item():
            assert top2.values[i, 0] - top2.values[i, 1] < 1e-4, (i, token, top2.indices[i].tolist())


def test_offline_batch_step_series_against_transformers_router(checkpoints, tmp_path):
    folder = checkpoints("mixtral")
    out = tmp_path / "run"
    run = run_cli(out, "--model", str(folder), "--workload", "offline_batch", "--requests", "4",
                  "--input-len", "20-40", "--output-len", "6")
    assert run["status"] == "complete" and run["engine"]["device"] == "cpu" and run["engine"]["dtype"] == "float32"
    req = pd.read_parquet(out / "requests.parquet").set_index("request_id")
    steps = pd.read_parquet(out / "steps.parquet")
    prompts = prompts_of(run)
    assert sorted(prompts) == sorted(req.index)
    P = {rid: len(p) for rid, p in prompts.items()}
    assert all(req.loc[rid, "prompt_tokens"] == n for rid, n in P.items())
    assert all(len(req.loc[rid, "output_ids"]) == 6 for rid in P)
    n_req, total_p = len(P), sum(P.values())
    # model_stats (what bytes read and FLOPs use) by hand, float32 = 4 bytes: per layer q 96x96
    # + k, v 96x32 + o 96x96 + two norms 96 + router 6x96 = 25,344 params; x 2 layers + final
    # norm 96 + LM head 257x96 = 24,672 gives 75,456 dense params (the embedding is not read
    # whole: one row per token). An expert: gate, up, down 3 x 96 x 64 = 18,432 params. Active
    # per token: 75,456 + 2 layers x top-2 x 18,432 = 149,184. K/V per token: 2 layers x (K, V)
    # x 2 KV heads x head dim 16 x 4 B = 512 B.
    # With MKL, packed for its GEMM: the LM head 257 x 96 and the 2 x 6 experts, (24,672 +
    # 221,184) x 4 B = 983,424 B.
    packed = {"prepacked_bytes": 983_424} if gemm.can_pack(torch.zeros(2, 2)) else {}
    assert run["engine"]["model_stats"] == {"dense_weight_bytes": 75_456 * 4, "bytes_per_expert": 18_432 * 4,
                                            "active_params_per_token": 149_184, "kv_bytes_per_token": 512,
                                            **packed, "cpu_attention_kernel": float(cpu_attention.available())}

    # The documented schedule: step 0 prefills every prompt (140 tokens at most < 2048), step j
    # decodes the j-th output token of every sequence; all finish in step 5.
    assert len(steps) == 6
    assert steps["prefill_tokens"].tolist() == [total_p, 0, 0, 0, 0, 0]
    assert steps["decode_tokens"].tolist() == [0] + [n_req] * 5
    assert steps["context_tokens"].tolist() == [total_p + n_req * j for j in range(6)]
    assert steps["running"].tolist() == [n_req] * 5 + [0]
    assert steps["waiting"].tolist() == [0] * 6 and steps["preempted"].tolist() == [0] * 6
    for col in ("h2d_bytes", "d2h_bytes", "h2d_transfers", "d2h_transfers"):
        assert steps[col].tolist() == [0] * 6, col

    # Experts hit: the distinct (layer, expert) pairs transformers' router picks for the
    # tokens each step computed (step 0: every prompt position; step j: position P + j - 1).
    hf = HFRouter(folder)
    sure_by_step: list[set] = [set() for _ in range(6)]
    maybe_by_step: list[set] = [set() for _ in range(6)]
    for rid, prompt in prompts.items():
        output = [int(t) for t in req.loc[rid, "output_ids"]]
        logits, routes = hf(list(prompt) + output[:-1])
        check_greedy(logits, len(prompt), output)
        for pos, per_layer in enumerate(routes):
            step = 0 if pos < len(prompt) else pos - len(prompt) + 1
            for layer, (sure, maybe) in enumerate(per_layer):
                sure_by_step[step] |= {(layer, e) for e in sure}
                maybe_by_step[step] |= {(layer, e) for e in maybe}
    hits = steps["experts_hit"].tolist()
    for step, hit in enumerate(hits):
        assert len(sure_by_step[step]) <= hit <= len(maybe_by_step[step]), (step, hit, sure_by_step[step])
    # Not a constant: decode steps of 4 tokens hit fewer experts than the 140-token prefill.
    assert len(set(hits)) > 1 and hits[0] == max(hits)
    assert run["summary"]["engine"]["experts_hit_per_step_mean"] == pytest.approx(sum(hits) / 6)


@pytest.mark.slow  # ~10 s on 2 cores; preemption stays covered by the engine tests
def test_rag_long_preemption_when_kv_is_small(checkpoints, tmp_path):
    # rag_long at a tenth of its size (prompts ~200-800 tokens), all 8 requests at t=0, a KV
    # cache of 64 blocks x 16 tokens = 1,024 tokens and 64 tokens per step: prompts are admitted
    # chunk by chunk while blocks last, so the cache fills and running sequences that need
    # another block preempt the newest ones (recomputed later).
    folder = checkpoints("mixtral", max_position_embeddings=4096)
    out = tmp_path / "run"
    blocks, block_size = 64, 16
    run = run_cli(out, "--model", str(folder), "--workload", "rag_long", "--requests", "8", "--scale", "0.1",
                  "--arrival", "offline", "--set", f"kv_blocks={blocks}", "--set", f"block_size={block_size}",
                  "--set", "max_num_batched_tokens=64", "--set", "prefix_caching=false")
    # Prefix caching off: the counts below are those of private blocks (with sharing, several
    # sequences attend the same blocks and a cached prefix is not computed; that is
    # tests/integration/test_prefix_caching.py's subject).
    assert run["status"] == "complete" and run["summary"]["completed"] == 8
    assert run["engine"]["kv_capacity_tokens"] == blocks * block_size
    req = pd.read_parquet(out / "requests.parquet").set_index("request_id")
    steps = pd.read_parquet(out / "steps.parquet")
    prompts = prompts_of(run)
    assert all(req.loc[rid, "prompt_tokens"] == len(p) for rid, p in prompts.items())
    assert (req["output_tokens"] == req["max_new_tokens"]).all()

    preempted = int(steps["preempted"].sum())
    assert preempted > 0 and run["summary"]["engine"]["preemptions"] == preempted
    # No step attends more K/V positions than the cache holds, and every step attends at
    # least the tokens it computed.
    assert (steps["context_tokens"] <= blocks * block_size).all()
    assert (steps["context_tokens"] >= steps["prefill_tokens"] + steps["decode_tokens"]).all()
    # Tokens computed: without preemption each request computes its prompt and all outputs
    # but the last (prefill = prompts, decode = outputs - 1 each). Recompute prefills again
    # what a preempted sequence had computed (> 0 tokens: it ran in an earlier step), and a
    # recomputed sequence's next token comes from that prefill, not a decode.
    n_out = int(req["output_tokens"].sum())
    assert (steps["prefill_tokens"] <= 64 - steps["decode_tokens"]).all()
    assert steps["prefill_tokens"].sum() > req["prompt_tokens"].sum()
    assert steps["decode_tokens"].sum() <= n_out - len(req)
    assert steps["prefill_tokens"].sum() + steps["decode_tokens"].sum() > req["prompt_tokens"].sum() + n_out - len(req)
    # Experts hit: within [top_k x layers, experts x layers] whenever a step computed tokens.
    cfg = json.loads((folder / "config.json").read_text())
    L, E, k = cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["num_experts_per_tok"]
    active = steps[steps["prefill_tokens"] + steps["decode_tokens"] > 0]
    assert ((active["experts_hit"] >= k * L) & (active["experts_hit"] <= E * L)).all()
    assert (steps.loc[steps["prefill_tokens"] + steps["decode_tokens"] == 0, "experts_hit"] == 0).all()
    assert (steps[["h2d_bytes", "d2h_bytes", "h2d_transfers", "d2h_transfers"]] == 0).all().all()
    # Preemption changed no output: each is transformers' greedy continuation of its prompt.
    hf = HFRouter(folder)
    for rid, prompt in prompts.items():
        output = [int(t) for t in req.loc[rid, "output_ids"]]
        logits, _ = hf(list(prompt) + output[:-1])
        check_greedy(logits, len(prompt), output)


@pytest.mark.gpu
def test_offline_batch_bytes_moved_on_cuda(checkpoints, tmp_path):
    """On CUDA the ledger counts what crosses the bus each step: the sampled token ids come
    back (int64, 8 B each: one per sequence here, every step), the step's inputs go over (at
    least ids, positions and KV slots, 8 B each per token), and no step re-sends the weights."""
    folder = checkpoints("mixtral")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--engine", "moe", "--device", "cuda",
                           "--warmup", "0", "--no-quality", "--output", str(out), "--quiet", "--model", str(folder),
                           "--workload", "offline_batch", "--requests", "4", "--input-len", "20-40", "--output-len",
                           "6"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    assert run["engine"]["device"].startswith("cuda")
    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == 6
    tokens = steps["prefill_tokens"] + steps["decode_tokens"]
    assert (steps["d2h_bytes"] >= 8 * 4).all() and (steps["d2h_transfers"] >= 1).all()
    assert (steps["h2d_bytes"] >= 3 * 8 * tokens).all() and (steps["h2d_transfers"] >= 3).all()
    assert (steps["h2d_bytes"] < run["engine"]["weight_bytes"]).all()
    s = run["summary"]["engine"]
    assert s["h2d_bytes"] == steps["h2d_bytes"].sum() and s["d2h_bytes"] == steps["d2h_bytes"].sum()
    assert s["h2d_bytes_per_output_token"] == pytest.approx(steps["h2d_bytes"].sum() / 24)
