#!/usr/bin/env bash
# The schemathesis fuzz of the HTTP API (tests/server/test_schemathesis.py: generated valid and invalid bodies
# must never get a 5xx and must match the schema) at a size for a slow run outside CI: TOKENMILL_FUZZ_SCALE=SCALE
# multiplies its examples (60 per generation mode of each POST route) and the cases it must run (200), so the
# default 5 runs >= 1,000 cases. Prints the number of cases and of 5xx answers; exits as pytest does.
# Usage: bash bench/scripts/fuzz_api.sh [SCALE]   (default 5)
set -euo pipefail
cd "$(dirname "$0")/../.."
SCALE=${1:-5}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
status=0
# pytest's own timeout (600 s in pyproject.toml) is sized for SCALE 1
TOKENMILL_FUZZ_SCALE=$SCALE .venv/bin/pytest -q -s -p no:cacheprovider --timeout $((600 * SCALE)) \
  tests/server/test_schemathesis.py 2>&1 | tee "$LOG" || status=$?
grep -E '^fuzz: ' "$LOG" || echo "fuzz: no count printed (the run stopped before the end; see above)"
exit $status
