#!/usr/bin/env bash
# Optional CI step: the real quantization tools as oracles for pwbench's quantized folders.
# Makes .venv-tools (GPTQModel, llm-compressor, compressed-tensors, all pinned in
# tests/quant/tools/requirements.txt) unless it is already there for these pins, then runs
# tests/quant/test_real_tools.py with the project's venv, the tools running in subprocesses
# from .venv-tools. Needs the project's .venv (made by .ci/run). CPU only; ~2 min install with a
# warm pip cache, ~4 min cold; tests ~6 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PWBENCH_TOOLS_VENV:-.venv-tools}"
REQ=tests/quant/tools/requirements.txt
MAIN_PY="${PWBENCH_MAIN_PYTHON:-.venv/bin/python}"
if [[ ! -x "$MAIN_PY" ]]; then
    echo "error: $MAIN_PY is missing; run .ci/run (or make the project venv) first" >&2
    exit 1
fi

want="$(cat "$REQ" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$want" ]]; then
    start=$SECONDS
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch first and alone: the CPU build from local disk; nothing below may pull another one.
    "$VENV/bin/python" -m pip install --quiet torch==2.13.0
    "$VENV/bin/python" -m pip install --quiet --no-deps -r "$REQ"
    "$VENV/bin/python" -m pip check
    echo "$want" > "$VENV/.requirements.sha256"
    echo "real tools installed in $VENV in $((SECONDS - start)) s"
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
print("real tools:", ", ".join(f"{d} {m.version(d)}" for d in ("gptqmodel", "llmcompressor", "compressed-tensors",
                                                              "transformers", "torch", "numpy")))
PY

# A missing tool fails this step instead of skipping quietly.
export PWBENCH_TOOLS_PYTHON="$PWD/$VENV/bin/python" PWBENCH_REAL_TOOLS_REQUIRED=1
exec "$MAIN_PY" -m pytest -q tests/quant/test_real_tools.py
