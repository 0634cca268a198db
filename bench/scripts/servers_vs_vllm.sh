#!/usr/bin/env bash
# tokenmill's server against vLLM's CPU server (the vllm peer's venv: `tokenmill bench setup-peer vllm`), the same
# client and workload (`tokenmill bench serve`: random-cpu token-id prompts, streamed, all at once), one server at a
# time, alternated ROUNDS times. Run alone. Writes OUT/serve-{tokenmill,vllm}-N.json.
#   bash bench/scripts/servers_vs_vllm.sh [OUT] [NUM_PROMPTS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/results/xeon-amx}
n=${2:-32}
rounds=${3:-2}
port=${PORT:-8011}
url=http://127.0.0.1:$port
tm=.venv/bin/tokenmill
vllm_py=${VLLM_PYTHON:-$HOME/.cache/tokenmill/peers/vllm/venv/bin/python}
model=$(.venv/bin/python -c "from tokenmill.bench.model_folder import resolve_model_folder; print(resolve_model_folder(None))")
mkdir -p "$out"

wait_ready() {  # $1: the server's pid
  for _ in $(seq 1 300); do
    curl -sf "$url/v1/models" > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { echo "the server died; see $out/serve.log"; exit 1; }
    sleep 2
  done
  echo "the server did not start"; exit 1
}

run() {  # $1: engine name; the rest: the server command
  local name=$1 i=$2; shift 2
  "$@" > "$out/serve.log" 2>&1 &
  local pid=$!
  wait_ready $pid
  $tm bench serve --base-url "$url" --workload random-cpu --num-prompts "$n" --request-rate inf \
    --vocab-size 49152 --output-json "$out/serve-$name-$i.json" | grep -i "output token throughput" || true
  kill $pid; wait $pid 2>/dev/null || true
}

cores=$(.venv/bin/python -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0))[:2])))")
for i in $(seq 1 "$rounds"); do
  run tokenmill "$i" $tm serve "$model" --port "$port" --log-level warning
  VLLM_CPU_OMP_THREADS_BIND=$cores VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
    run vllm "$i" "$vllm_py" -m vllm.entrypoints.openai.api_server --model "$model" --dtype bfloat16 \
    --port "$port" --max-model-len 2048
done
.venv/bin/python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tok = {e: [json.load(open(f"{out}/serve-{e}-{i}.json"))["results"][0]["output_throughput"] for i in range(1, rounds + 1)]
       for e in ("tokenmill", "vllm")}
med = {e: statistics.median(v) for e, v in tok.items()}
print(f"output tok/s: tokenmill {tok['tokenmill']} vllm {tok['vllm']}; medians {med['tokenmill']:.1f} / "
      f"{med['vllm']:.1f} = {med['tokenmill'] / med['vllm']:.2f}x")
PY
