#!/usr/bin/env bash
# Fetch into .whl/ the wheels a GPU machine without a package index needs beside its own torch, Triton
# and transformers stack (bench/scripts/gpu.sh installs them there), at the versions of this checkout's
# .venv, built for the GPU machine's Python (default 3.12).
#   bash bench/scripts/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver=${1:-3.12}
# What tokenmill imports that such an image may lack (fastapi pulls opentelemetry-api; transformers 5
# needs tokenizers, safetensors and regex at least as new as these).
names=(gguf fastapi starlette uvicorn httptools pydantic pydantic_core annotated-types typing-inspection
    llguidance opentelemetry-api transformers tokenizers safetensors regex typing_extensions)
pins=()
for name in "${names[@]}"; do
    version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("$name==$version")
done
platforms=()
for p in manylinux_2_{17,24,27,28,31,34}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
mkdir -p .whl
grep -qxF /.whl/ .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude  # never committed
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
