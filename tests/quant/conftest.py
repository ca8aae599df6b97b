"""Kernel tests run the Triton kernels on CPU under the interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when engines.quant.triton_kernels
is first imported; that happens inside a test, after this conftest has set it. With CUDA the
same tests run compiled on the GPU instead.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def use_kernels(monkeypatch):
    """use_kernels("triton" | "torch"): make the public ops resolve to that implementation."""
    from engines.quant.ops import KERNELS_ENV, kernel_impl

    def use(impl: str) -> str:
        monkeypatch.setenv(KERNELS_ENV, impl)
        kernel_impl.cache_clear()
        return kernel_impl()

    yield use
    kernel_impl.cache_clear()  # monkeypatch restores the env after this; resolve afresh next time
