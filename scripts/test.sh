#!/usr/bin/env bash
# Everything CI checks, in order of cost: lint, formatting, the import contract, types, then the tests; first the
# test and plot extras (scripts/setup.sh installs the runtime only). The C++ kernels compile in the background
# meanwhile: the AVX2 build, and the native one where setup.sh did not build today's sources, so the tests start
# with both cached.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
logs=$(mktemp -d)
$bin/python -m tokenmill.ops.build > $logs/native.log 2>&1 &
native=$!
avx2=""
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo; then
  TOKENMILL_CPU_ISA=avx2 $bin/python -m tokenmill.ops.build > $logs/avx2.log 2>&1 &
  avx2=$!
fi
echo "== test extras";     $bin/python -m pip install -q -e '.[test,plot]'
echo "== ruff";            $bin/ruff check .
echo "== ruff format";     $bin/ruff format --check .
echo "== clang-format";    $bin/clang-format --dry-run --Werror tokenmill/ops/csrc/*.h tokenmill/ops/csrc/*.cpp
echo "== import contract"; $bin/lint-imports
echo "== mypy";            $bin/mypy
# A failed build is the tests' to report (tests/kernels/test_kernel_builds.py fails; the engine falls back).
echo "== kernel builds";   wait $native $avx2 || true; cat $logs/*.log
echo "== tests";           $bin/python -m pytest -q "$@"
