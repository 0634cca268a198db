#!/usr/bin/env bash
# Issue 32's measurements on an AVX2-only CPU, or, on a CPU with AVX-512, with every engine restricted to AVX2
# (`bench compare --cpu-isa avx2`: torch, MKL, oneDNN, vLLM's _C_AVX2 kernels, an AVX2 build of ggml).
# Run alone (nothing else on the machine); writes one JSON per comparison into OUT (default bench/results/avx2).
#   bash bench/scripts/avx2.sh [OUT] [NUM_PROMPTS] [REPEAT]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/results/avx2}
n=${2:-32}
repeat=${3:-2}
mkdir -p "$out"
isa=()
grep -qw avx512f /proc/cpuinfo && isa=(--cpu-isa avx2)  # an AVX2-only CPU runs natively
tm=.venv/bin/tokenmill
# 1. random-cpu, tokenmill's default against each peer at its best float dtype on this CPU.
$tm bench compare "${isa[@]}" --workload random-cpu --num-prompts "$n" --repeat "$repeat" --peers vllm,llamacpp \
  --peer-dtype best --output-json "$out/random-cpu.json"
# 2. HF transformers at float32 (its best dtype without bf16 arithmetic: bf16 runs ~2.5x slower), batches of 32.
$tm bench compare "${isa[@]}" --workload random-cpu --num-prompts "$n" --repeat "$repeat" --peers hf --dtype float32 \
  --hf-batch-sizes 32 --output-json "$out/random-cpu-hf.json"
# 3. Batch-1 decode at the same precision as llama.cpp (bf16 weights).
$tm bench compare "${isa[@]}" --workload fixed-128-1024 --max-output-len 256 --num-prompts 4 --max-num-seqs 1 \
  --repeat "$repeat" --peers llamacpp --dtype bfloat16 --output-json "$out/batch1.json"
# 4. int8 weights (llama.cpp: q8_0) on random-cpu.
$tm bench compare "${isa[@]}" --workload random-cpu --num-prompts "$n" --repeat "$repeat" --peers llamacpp \
  --dtype int8 --output-json "$out/int8.json"
