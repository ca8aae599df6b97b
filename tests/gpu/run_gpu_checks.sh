#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one go, each step's log kept in LOGS (default: a new temporary
# folder; on the device machine pass LOGS=$OUT):
#   0. `pwbench hw --device cuda`: this GPU's memory, matmul and pinned host<->device rates;
#   1. the simulator's validation on this GPU (`python -m harness.bench.simulate --device cuda`: every
#      engine measured in bf16 and simulated on the GPU's profile, replaying the measured routing), on
#      Mixtral-8x7B's own layer dimensions (2 layers) and on the bundled model; the runs' result
#      folders go to LOGS/sim-runs.tar.gz (the models left out);
#   2. the gpu-marked tests: the quantized kernels compiled on the GPU, the engines on CUDA against
#      the CPU reference, bytes moved (the CPU tests run in CI);
#   3. the kernel benchmark against bf16, with achieved memory bandwidth.
# Each step runs under its own time limit (seconds: HW_S, SIM_LAYERS_S, SIM_DEMO_S, TESTS_S, KERNELS_S); a step
# that fails or runs out of time is named at the end and the others still run; the exit status is
# non-zero if any failed.
# Usage: [LOGS=DIR] bash tests/gpu/run_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."

python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU is visible; run this on a GPU machine")' || exit 1
LOGS=${LOGS:-$(mktemp -d -t pwbench-gpu-checks-XXXX)}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
python -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)' \
  | tee "$LOGS/device.log"
failed=()

step() {  # step NAME SECONDS COMMAND...: run it under the limit, its output to the screen and LOGS/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || failed+=("$name (exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ', out of time'))")
}

step hw "${HW_S:-300}" python -m harness.cli hw --device cuda
runs=$(mktemp -d -t pwbench-sim-runs-XXXX)
step simulate "${SIM_LAYERS_S:-1800}" python -m harness.bench.simulate --device cuda --models mixtral_layers \
  --engines moe,offload,moegen,static-rtn,pagedweight,full --keep "$runs"
step simulate "${SIM_DEMO_S:-900}" python -m harness.bench.simulate --device cuda --models demo --keep "$runs"
tar czf "$LOGS/sim-runs.tar.gz" -C "$runs" --exclude='*-shaped' . && rm -rf "$runs"
step tests "${TESTS_S:-1800}" python -m pytest tests/quant tests/gpu -m gpu -q -ra --durations=10 -p no:cacheprovider
step kernels "${KERNELS_S:-600}" python -m harness.bench.kernels --tokens 1,16,128,1024

echo "logs: $LOGS"
if ((${#failed[@]})); then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all GPU checks passed"
