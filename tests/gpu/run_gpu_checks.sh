#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one go: the quantized-kernel tests compiled on the GPU
# and the engine tests on CUDA (tests/gpu: float32 and bf16 against the CPU reference, bytes moved)
# (all dtypes, the gpu-marked larger shapes included), then the kernel benchmark against bf16
# with achieved memory bandwidth. Usage: bash tests/gpu/run_gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU is visible; run this on a GPU machine")'
python -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)'
python -m pytest tests/quant tests/gpu -q -ra --durations=10
python -m harness.bench.kernels --tokens 1,16,128,1024
