#!/usr/bin/env bash
# Serving against offline throughput, one run after the other on a quiet machine (BENCHMARKS.md):
#   1. `tokenmill serve` (engine core in its own process) + `bench serve --request-rate inf` -> saturation
#   2. the same server at 50% and 80% of that request rate (Poisson, 32 requests) -> TTFT / TPOT
#   3. the server stopped, `bench throughput` on the same workload and model -> the offline reference
# Usage: bash bench/scripts/serving.sh [OUT_DIR]   (default bench/results); extra server flags in $SERVE_ARGS;
# RATES="50 80" (the default) picks the shares of saturation for step 2, RATES="" skips it.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/results}
PORT=${PORT:-8011}
TM=.venv/bin/tokenmill
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"

# shellcheck disable=SC2086
$TM serve --port "$PORT" --log-level warning ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "$URL/ready" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "the server died; see $OUT/serve.log"; exit 1; }
  sleep 2
done

$TM bench serve --base-url "$URL" --workload random-cpu --request-rate inf --output-json "$OUT/serve-random-cpu-inf.json"
RATE=$(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['results'][0]['request_throughput'])" \
  "$OUT/serve-random-cpu-inf.json")
for PCT in ${RATES-50 80}; do
  R=$(.venv/bin/python -c "print(round($RATE * $PCT / 100, 4))")
  $TM bench serve --base-url "$URL" --workload random-cpu --num-prompts 32 --request-rate "$R" \
    --output-json "$OUT/serve-random-cpu-${PCT}pct.json"
done
kill $SERVER; wait $SERVER 2>/dev/null || true

$TM bench throughput --workload random-cpu --output-json "$OUT/random-cpu-fp32.json"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
served = json.load(open(f"{out}/serve-random-cpu-inf.json"))["results"][0]["output_throughput"]
offline = json.load(open(f"{out}/random-cpu-fp32.json"))["results"]["output_tok_s"]
print(f"serve at rate inf / offline throughput: {served:.1f} / {offline:.1f} = {served / offline:.2f}x")
PY
