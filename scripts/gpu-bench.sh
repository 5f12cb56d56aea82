#!/usr/bin/env bash
# GPU figures beyond gpu-check.sh, in one command on a machine with one NVIDIA GPU, from a copy
# of the repository that holds the GPU kit (scripts/cuda-build.sh: target/gpu-kit):
#   1. gpu-check.sh from the kit (its summary);
#   2. the 95M Llama's step against PyTorch on cuda:0 (scripts/bench-torch.py --backend cuda,
#      single, f32 and bf16), where python3 has torch and transformers;
#   3. the 95M step of ours under single, fsdp2 on 1 rank and on 2 rank threads sharing the GPU,
#      f32 and bf16, with the forward/backward/optimizer split of each step; single f32 and bf16
#      again with compile on (Burn's kernel fusion, `enable_compile: true`).
# Everything is printed and kept under $OUT (default /tmp/gpu-bench). About 4 minutes on an H200.
# Environment: OUT, GPU_BENCH_STEPS (default 5).
set -u
cd "$(dirname "$0")/.."
repo="$PWD"
kit=target/gpu-kit
out="${OUT:-/tmp/gpu-bench}"
steps="${GPU_BENCH_STEPS:-5}"
mkdir -p "$out"
[[ -f "$kit/gpu-check.sh" ]] || { echo "gpu-bench: no $kit: build it with scripts/cuda-build.sh" >&2; exit 2; }
t0=$SECONDS

export GPU_CHECK_WORK=/tmp/gpu-bench-work GPU_CHECK_KEEP=1 GPU_CHECK_BUDGET=240
timeout 260 bash "$kit/gpu-check.sh" >"$out/gpu-check.log" 2>&1
echo "gpu-check exit $? after $((SECONDS - t0)) s"
sed -n '/== summary/,$p' "$out/gpu-check.log"

export TRAIN_LLAMA="$GPU_CHECK_WORK/train_llama" PYTHONUNBUFFERED=1 CUDA_PATH="$repo/$kit"
for dtype in f32 bf16; do
  timeout 120 python3 scripts/bench-torch.py --backend cuda --model 95m --strategies single \
    --rounds 1 --steps 10 --dtype "$dtype" >"$out/bench-$dtype.log" 2>&1
  echo "bench-torch $dtype exit $? at $((SECONDS - t0)) s"
  tail -n 4 "$out/bench-$dtype.log"
done

common=(--backend cuda --engine threads --config "$repo/examples/models/llama_95m.json"
  --global-batch 8 --seq-len 128 --optimizer adamw --lr 3e-3 --grad-clip 1.0 --json
  --steps "$steps")
printf 'enable_compile: true\n' >"$out/compile.yaml"
for run in "single 1 f32" "fsdp2 1 f32" "fsdp2 2 f32" "single 1 bf16" "fsdp2 2 bf16" \
  "single 1 f32 compile" "single 1 bf16 compile"; do
  read -r strategy world dtype compile <<<"$run"
  extra=()
  [[ $dtype == bf16 ]] && extra=(--param-dtype bf16 --reduce-dtype f32)
  [[ -n $compile ]] && extra+=(--distributed-config "$out/compile.yaml")
  name="$strategy-x$world-$dtype${compile:+-compile}"
  # LOCAL_RANK=0: every rank thread on GPU 0.
  LOCAL_RANK=0 timeout 90 "$TRAIN_LLAMA" "${common[@]}" "${extra[@]}" --strategy "$strategy" \
    --world-size "$world" >"$out/$name.json" 2>"$out/$name.err"
  echo "== $name exit $? at $((SECONDS - t0)) s"
  python3 - "$out/$name.json" <<'PY'
import json, sys
keys = ("step", "loss", "step_time_s", "forward_s", "backward_s", "optimizer_s", "tokens_per_s",
        "kernels", "fused_kernels")
for line in open(sys.argv[1]):
    if line.startswith("{"):
        step = json.loads(line)
        print({k: round(step[k], 4) for k in keys if k in step})
PY
  grep -i "error" "$out/$name.err" | tail -n 2
done
