#!/usr/bin/env bash
# The schemathesis fuzz of the HTTP API (tests/server/test_schemathesis.py: generated valid and invalid bodies
# for every route in /openapi.json must never get a 5xx and must match the schema) at a size for a slow run
# outside CI: SCALE multiplies its examples (60 per generation mode for chat and completions, 10 for every other
# route with a body, 5 for the rest) and the cases it must run (200). The result (cases and statuses by route,
# the 5xx answers) is kept as JSON with the command, commit and CPU. Exits as pytest does.
# Usage: bash bench/scripts/fuzz_api.sh [SCALE] [OUTPUT]   (defaults 5, bench/results/fuzz_api.json)
set -euo pipefail
cd "$(dirname "$0")/../.."
SCALE=${1:-5}
OUTPUT=${2:-bench/results/fuzz_api.json}
status=0
# pytest's own timeout (600 s in pyproject.toml) is sized for SCALE 1
TOKENMILL_FUZZ_SCALE=$SCALE TOKENMILL_FUZZ_OUTPUT=$OUTPUT .venv/bin/pytest -q -s -p no:cacheprovider \
  --timeout $((600 * SCALE)) tests/server/test_schemathesis.py || status=$?
if [ -f "$OUTPUT" ]; then
  .venv/bin/python - "$OUTPUT" "bash bench/scripts/fuzz_api.sh $*" <<'PY'
import json, platform, subprocess, sys
path, command = sys.argv[1], sys.argv[2]
result = json.load(open(path))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
flags = open("/proc/cpuinfo").read().split()
isa = "amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else "avx2"
meta = {"command": command.strip(), "commit": commit, "cpu": platform.processor() or platform.machine(), "isa": isa}
json.dump(meta | result, open(path, "w"), indent=1)
print(f"fuzz: {result['cases']} cases, {result['server_errors']} 5xx; kept in {path}")
PY
else
  echo "fuzz: no result written (the run stopped before the end; see above)"
fi
exit $status
