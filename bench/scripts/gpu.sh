#!/usr/bin/env bash
# Issue 33 in one run on a GPU machine: the GPU tests, then the benchmarks, logs and JSON into OUT_DIR.
#
#   bash bench/scripts/gpu.sh OUT_DIR [STEP ...]     # the steps (run_step below) in this order; none: all
#
# The machine's own torch (CUDA), Triton and transformers stay; what tokenmill needs beside them and the
# machine lacks travels as wheels in .whl/ (bench/scripts/gpu_wheels.sh fetches them) and is
# installed into /tmp/site. Every step has a time limit, and the whole run a budget (GPU_SH_BUDGET_S
# seconds, default 480): a step that would start past it is skipped and says so, so the summary and
# OUT_DIR/steps.tsv always come back. GPU_SH_SMOKE=1 runs the same steps tiny, on the CPU, to check this
# script's plumbing without a GPU.
set -u
out=${1:?usage: gpu.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
budget=${GPU_SH_BUDGET_S:-480}
start=$SECONDS

if [ "${GPU_SH_SMOKE:-0}" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$out/pip.log" 2>&1 || { echo "installing .whl/ failed: $out/pip.log"; cat "$out/pip.log"; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

if [ "${GPU_SH_SMOKE:-0}" = 1 ]; then
    device=cpu small=smollm2-135m big=smollm2-135m
    sizes=(--num-prompts 4 --max-prompt-len 64 --max-output-len 8)
    slice=4 sharegpt=4 profile_steps=(--skip-steps 2 --steps 3)
else
    device=cuda small=qwen3-0.6b big=llama-3-8b
    sizes=()
    slice=64 sharegpt=1000 profile_steps=()
fi
# vLLM's GPU defaults: 256 running sequences, 8192 tokens a step (tokenmill's defaults are sized for a CPU).
gpu_args=(--load-format dummy --device "$device" --max-num-seqs 256 --max-num-batched-tokens 8192)
tm=($py -m tokenmill.cli bench throughput)

printf 'step\trc\tseconds\n' >"$out/steps.tsv"
# step NAME LIMIT_S CMD...: run CMD with its output in OUT_DIR/NAME.log, unless the budget is spent.
step() {
    local name=$1 limit=$2 left=$((budget - (SECONDS - start)))
    shift 2
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left}s of the budget left"
        printf '%s\tskipped\t0\n' "$name" >>"$out/steps.tsv"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$out/steps.tsv"
    echo "   rc $rc in $((SECONDS - t0))s; last lines:"
    tail -n 6 "$out/$name.log" | cut -c1-300 | sed 's/^/   | /'
}

run_step() {
    case $1 in
    env) step env 60 bash -c "nvidia-smi; $py -c 'import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.is_available())'" ;;
    # The Triton kernels compile once per variant: in parallel workers. The engine tests share one GPU's memory: serially.
    test_kernels) step test_kernels 150 $py -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_triton_attention.py tests/kernels/test_cuda_graph.py tests/kernels/test_triton_fused.py tests/kernels/test_triton_sampler.py tests/kernels/test_triton_nucleus.py ;;
    test_e2e) step test_e2e 200 $py -m pytest -q -p no:cacheprovider tests/e2e/test_gpu_path_e2e.py tests/e2e/test_cuda_hf_equivalence.py ;;
    random_gpu) step random_gpu 150 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" "${sizes[@]}" --output-json "$out/random_gpu.json" ;;
    # Async scheduling off (it is on by default on CUDA): what the overlapped step gains.
    random_gpu_sync) step random_gpu_sync 150 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" "${sizes[@]}" --async-scheduling off --output-json "$out/random_gpu_sync.json" ;;
    random_gpu_eager) step random_gpu_eager 150 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" "${sizes[@]}" --enforce-eager --output-json "$out/random_gpu_eager.json" ;;
    sharegpt_8b) step sharegpt_8b 240 "${tm[@]}" --workload sharegpt-like --num-prompts $sharegpt --model $big "${gpu_args[@]}" "${sizes[@]:2}" --output-json "$out/sharegpt_8b.json" ;;
    # HF transformers on a slice of random-gpu, and tokenmill on the same slice.
    hf_slice) step hf_slice 150 $py bench/scripts/gpu_hf.py --model $small --workload random-gpu --num-prompts $slice "${sizes[@]:2}" --batch-size $slice --device "$device" --output-json "$out/hf_slice.json" ;;
    tokenmill_slice) step tokenmill_slice 90 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" --num-prompts $slice "${sizes[@]:2}" --output-json "$out/tokenmill_slice.json" ;;
    # Continuous against static batches, both at 64 running requests (so that refilling matters).
    continuous_64) step continuous_64 120 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" "${sizes[@]}" --max-num-seqs 64 --output-json "$out/continuous_64.json" ;;
    static_64) step static_64 150 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" "${sizes[@]}" --max-num-seqs 64 --static-batching --output-json "$out/static_64.json" ;;
    # INT8 weights (on CUDA through the dequantizing reference path: no int8 GEMM kernel there yet), and
    # speculative decoding with a draft of the same preset and seed (the same weights: every draft is
    # accepted, the mechanism's best case), each on the 64-request slice.
    int8) step int8 120 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" --num-prompts $slice "${sizes[@]:2}" --quantization int8 --output-json "$out/int8.json" ;;
    spec_same_draft) step spec_same_draft 120 "${tm[@]}" --workload random-gpu --model $small "${gpu_args[@]}" --num-prompts $slice "${sizes[@]:2}" --speculative-config "{\"method\": \"draft_model\", \"model\": \"$small\", \"num_speculative_tokens\": 4}" --output-json "$out/spec_same_draft.json" ;;
    # Where a decode step's time goes: the host's phases and the device's kernels (torch.profiler).
    profile) step profile 120 $py bench/scripts/gpu_profile.py --workload random-gpu --model $small "${gpu_args[@]}" "${sizes[@]}" "${profile_steps[@]}" --out-dir "$out/profile" ;;
    roofline) step roofline 90 $py bench/scripts/gpu_roofline.py --model $small --device "$device" --output-json "$out/roofline.json" "$out"/random_gpu*.json "$out/continuous_64.json" ;;
    roofline_8b) step roofline_8b 60 $py bench/scripts/gpu_roofline.py --model $big --device "$device" --output-json "$out/roofline_8b.json" "$out/sharegpt_8b.json" ;;
    *) echo "unknown step $1" ;;
    esac
}

steps=("$@")
# The profile first: where a step's time goes decides what to fix, even if the budget ends the run early.
[ ${#steps[@]} -eq 0 ] && steps=(env profile test_kernels test_e2e random_gpu random_gpu_sync random_gpu_eager sharegpt_8b
    hf_slice tokenmill_slice continuous_64 static_64 roofline roofline_8b int8 spec_same_draft)
for name in "${steps[@]}"; do run_step "$name"; done

echo "== summary ($((SECONDS - start))s)"
column -t "$out/steps.tsv" 2>/dev/null || cat "$out/steps.tsv"
$py - "$out" <<'EOF'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    data = json.loads(path.read_text())
    res = data.get("results", data)
    if "output_tok_s" in res:
        print(f"{path.stem:20s} output {res['output_tok_s']:9.1f} tok/s  total {res['total_tok_s']:9.1f} tok/s  "
              f"elapsed {res['elapsed_s']:6.1f} s  requests {res.get('num_requests')}")
    for run in data.get("runs", []):
        print(f"{path.stem:20s} {run['result']}: {run['fraction_of_decode_ceiling']:.1%} of the decode ceiling "
              f"({run['roofline']['ceiling_tok_s']:.0f} tok/s, {run['roofline']['bound']})")
EOF
