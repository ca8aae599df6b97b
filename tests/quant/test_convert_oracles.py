"""compressed-tensors' own packer and unpacker as the oracle, when installed beside the project.

The library is kept out of the main environment (it pins versions we do not want to move):
install it once into a folder of its own, and these tests run it in a subprocess with that
folder on PYTHONPATH, sharing our torch; without it they skip and say how to install it:

    python -m pip install --no-deps --target ~/.cache/pwbench/oracles/compressed-tensors-0.20.1 \
        compressed-tensors==0.20.1 loguru

GPTQModel (sdist only, native build, numpy pinned) and AutoAWQ (needs CUDA) have no oracle
here; the hand-packed tests in test_convert.py cover their layouts. transformers 5.24 has no
CPU unpack helper for AWQ or GPTQ to check against.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.quant.convert import from_compressed_tensors, to_compressed_tensors
from engines.quant.qweight import SUPPORTED_BITS, dequantize, quantize_rtn, unpack

CT_VERSION = "0.20.1"
ORACLE_DIR = Path(os.environ.get("PWBENCH_CACHE",
                                 Path.home() / ".cache" / "pwbench")) / "oracles" / f"compressed-tensors-{CT_VERSION}"

CASES = [(bits, symmetric) for bits in SUPPORTED_BITS for symmetric in (False, True)]
GROUP_SIZE = 32

# Runs under the oracle's PYTHONPATH: compress (quantize + pack) and decompress each job with
# the library, all in one process (importing it costs seconds).
ORACLE_SCRIPT = """
import sys, torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as C
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
results = []
for job in torch.load(sys.argv[1]):
    args = QuantizationArgs(num_bits=job["bits"], type="int", symmetric=job["symmetric"], strategy="group",
                            group_size=job["group_size"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    packed = C.compress(job["state_dict"], scheme)
    results.append({"packed": packed, "weight": C.decompress(packed, scheme)["weight"]})
torch.save(results, sys.argv[2])
"""


def case_weight(bits: int, symmetric: bool):
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(bits))
    return quantize_rtn(w, bits, GROUP_SIZE, symmetric, scale_dtype=torch.float32)


@pytest.fixture(scope="module")
def ct_results(tmp_path_factory):
    """The library's output for every case, or a skip saying how to install it."""
    if not (ORACLE_DIR / "compressed_tensors").is_dir():
        pytest.skip(f"compressed-tensors oracle not installed: python -m pip install --no-deps --target "
                    f"{ORACLE_DIR} compressed-tensors=={CT_VERSION} loguru")
    jobs = []
    for bits, symmetric in CASES:
        qw = case_weight(bits, symmetric)
        state = {"weight": dequantize(qw), "weight_scale": qw.scales}
        if not symmetric:  # the library's zero point is signed: code - 2^(bits-1)
            state["weight_zero_point"] = (unpack(qw)[1].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
        jobs.append({"bits": bits, "group_size": GROUP_SIZE, "symmetric": symmetric, "state_dict": state})
    tmp = tmp_path_factory.mktemp("ct-oracle")
    torch.save(jobs, tmp / "jobs.pt")
    env = {**os.environ, "PYTHONPATH": str(ORACLE_DIR)}
    proc = subprocess.run([sys.executable, "-c", ORACLE_SCRIPT, str(tmp / "jobs.pt"), str(tmp / "out.pt")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(zip(CASES, torch.load(tmp / "out.pt")))


@pytest.mark.parametrize("bits, symmetric", CASES)
def test_compressed_tensors_library_agrees_both_ways(ct_results, bits, symmetric):
    got = ct_results[(bits, symmetric)]
    ours = to_compressed_tensors(case_weight(bits, symmetric))
    assert set(ours) == set(got["packed"])
    for name, t in got["packed"].items():
        assert torch.equal(ours[name], t), name  # our writer = the library's writer, bit for bit
    back = from_compressed_tensors(**got["packed"], bits=bits, group_size=GROUP_SIZE, symmetric=symmetric)
    assert torch.equal(dequantize(back), got["weight"])  # our reader = the library's reader
