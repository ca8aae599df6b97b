"""How the public ops pick an implementation, what importing them pulls in, and bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engines.base import EngineError
from engines.quant.ops import dequant_matmul, fused_moe, kernel_impl
from engines.quant.qweight import QuantFormatError, quantize_experts, quantize_rtn
from engines.runtime.experts import Dispatch
from engines.runtime.weights import DenseExperts

QUANT_MODULES = ("qweight", "convert", "ops", "configs", "tune", "rtn")


def test_importing_engines_quant_never_imports_triton():
    code = "import sys\n" + "".join(f"import engines.quant.{m}\n"
                                    for m in QUANT_MODULES) + "print('triton' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is triton where CUDA exists")
def test_default_is_torch_without_cuda_and_the_env_overrides(use_kernels, monkeypatch):
    monkeypatch.delenv("PWBENCH_KERNELS", raising=False)
    kernel_impl.cache_clear()
    assert kernel_impl() == "torch"
    assert use_kernels("triton") == "triton"  # TRITON_INTERPRET=1 (conftest) allows it on CPU
    assert use_kernels("TORCH") == "torch"


def test_resolved_once_until_cleared(use_kernels, monkeypatch):
    use_kernels("torch")
    monkeypatch.setenv("PWBENCH_KERNELS", "triton")
    assert kernel_impl() == "torch"  # decided once per process; only cache_clear() re-reads


def test_bad_choices_are_one_line_errors(use_kernels, monkeypatch):
    with pytest.raises(EngineError, match=r"PWBENCH_KERNELS must be one of \('torch', 'triton'\), got 'cuda'"):
        use_kernels("cuda")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(EngineError, match="needs a CUDA device, or TRITON_INTERPRET=1"):
            use_kernels("triton")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs_are_refused_before_either_implementation(use_kernels, impl):
    use_kernels(impl)
    qw = quantize_rtn(torch.randn(16, 64), 4, 32)
    with pytest.raises(QuantFormatError, match=r"dequant_matmul: x must be \[T, 64\], got \[3, 32\]"):
        dequant_matmul(torch.randn(3, 32), qw)
    with pytest.raises(QuantFormatError, match="x dtype must be one of"):
        dequant_matmul(torch.ones(3, 64, dtype=torch.int32), qw)
    with pytest.raises(QuantFormatError, match="expects one matrix"):
        dequant_matmul(torch.randn(3, 64), quantize_rtn(torch.randn(2, 16, 64), 4, 32))
    experts = quantize_experts(DenseExperts(torch.randn(2, 64, 32), torch.randn(2, 32, 32)), 4, 32)
    bad = Dispatch(torch.zeros(3, dtype=torch.long), torch.ones(3), [3])
    with pytest.raises(QuantFormatError, match="dispatch has 1 expert counts summing to 3.*layer has 2 experts"):
        fused_moe(torch.randn(3, 32), bad, experts)
