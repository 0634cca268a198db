#!/usr/bin/env bash
# int8 against bf16 decode at 1, 4 and 8 rows (BENCHMARKS.md): `bench throughput` on a decode-heavy
# workload (128 prompt / 256 output tokens), RUNS runs of each precision, interleaved, one JSON each;
# tables of whole-request output tok/s and of decode-only-step tok/s.
# Usage: bash bench/scripts/int8_vs_bf16.sh [OUT_DIR]   (default bench/results/batch-int8-vs-bf16)
# INT8_KV=int8: the int8 runs also keep an int8 KV cache (--kv-cache-dtype int8; default auto: bf16).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/results/batch-int8-vs-bf16}
RUNS=${RUNS:-2}
mkdir -p "$OUT"
for rows in 1 4 8; do
  prompts=$(( rows == 1 ? 4 : 2 * rows ))
  for run in $(seq 1 "$RUNS"); do
    for precision in bf16 int8; do
      quant=(); [ "$precision" = int8 ] && quant=(--quantization int8 --kv-cache-dtype "${INT8_KV:-auto}")
      .venv/bin/tokenmill bench throughput --workload fixed-128-1024 --max-output-len 256 \
        --num-prompts "$prompts" --max-num-seqs "$rows" --dtype bfloat16 "${quant[@]}" \
        --output-json "$OUT/$precision-b$rows-r$run.json" > /dev/null 2>&1
    done
  done
done
.venv/bin/python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
# output tok/s: whole requests (each wave's 128-token prefills included); decode tok/s: the steps
# that ran only decode rows (bench throughput's decode_tok_s)
for metric, label in (("output_tok_s", "output"), ("decode_tok_s", "decode")):
    print(f"\n| rows (B) | bf16 {label} tok/s | int8 {label} tok/s | int8 / bf16 (medians) |\n|---|---|---|---|")
    for rows in (1, 4, 8):
        runs = {p: [json.loads(f.read_text())["results"][metric] for f in sorted(out.glob(f"{p}-b{rows}-r*.json"))]
                for p in ("bf16", "int8")}
        ratio = statistics.median(runs["int8"]) / statistics.median(runs["bf16"])
        cells = [", ".join(f"{v:.1f}" for v in runs[p]) for p in ("bf16", "int8")]
        print(f"| {rows} | {cells[0]} | {cells[1]} | {ratio:.2f}x |")
PY
