#!/usr/bin/env bash
# Everything CI checks, in order of cost: lint, formatting, the import contract, types, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
echo "== ruff";            $bin/ruff check .
echo "== ruff format";     $bin/ruff format --check .
echo "== clang-format";    $bin/clang-format --dry-run --Werror tokenmill/ops/csrc/*.h tokenmill/ops/csrc/*.cpp
echo "== import contract"; $bin/lint-imports
echo "== mypy";            $bin/mypy
echo "== tests";           $bin/python -m pytest -q "$@"
