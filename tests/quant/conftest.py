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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (its subprocesses get OMP_NUM_THREADS=1 too). Calibration
    and the folder tests are thousands of small tensor ops: with the CPUs busy, a second
    intra-op thread only adds scheduler waits (measured 198 s instead of 10 s per case on a
    loaded 2-core box). Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
