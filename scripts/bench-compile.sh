#!/usr/bin/env bash
# Compile on against compile off on the wgpu lane, in one command: the hf-3m Llama
# (examples/models/llama_hf3m.json) on `--backend wgpu` (Burn's CubeCL backend; without a GPU,
# Mesa's llvmpipe), AdamW, a global batch of 8 x 128 tokens, with `enable_compile: false` and
# `true` (Burn's kernel fusion), alternating over R rounds (default 2) of 8 steps. Each mode runs
# in its own process (Burn chooses fused or eager once per process). Figures: the median step
# time of steps 3-8 over the rounds, and on/off; the median kernels a step ran (the step JSON's
# `kernels`, Burn's fusion counting them) and how many of them fused operations.
#
# Usage: scripts/bench-compile.sh [--rounds R]   (keep the machine otherwise idle)
# Builds `train_llama` in release with --features "wgpu fusion" unless TRAIN_LLAMA names a
# binary built with both.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    *) echo "unknown argument $1 (usage: $0 [--rounds R])" >&2; exit 2 ;;
  esac
done

bin="${TRAIN_LLAMA:-}"
if [ -z "$bin" ]; then
  cargo build --release --locked --features "wgpu fusion" --example train_llama
  bin=target/release/examples/train_llama
fi
work=target/bench-compile
mkdir -p "$work"
printf 'enable_compile: false\n' > "$work/off.yaml"
printf 'enable_compile: true\n' > "$work/on.yaml"
# As CI's wgpu lane: Burn's default device stays flex, so nothing but the trainer's own device
# setup starts the wgpu runtime (docs/wgpu.md).
export BURN_DEVICE=flex

for round in $(seq "$rounds"); do
  for mode in off on; do
    "$bin" --json --strategy single --world-size 1 --steps 8 --global-batch 8 --seq-len 128 \
      --optimizer adamw --lr 3e-4 --grad-clip 1.0 --backend wgpu \
      --config examples/models/llama_hf3m.json --distributed-config "$work/$mode.yaml" \
      > "$work/$mode-$round.jsonl" 2> "$work/$mode-$round.log"
  done
done

python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def median(mode, key):
    values = []
    for round in range(1, rounds + 1):
        steps = [json.loads(l) for l in open(f"{work}/{mode}-{round}.jsonl") if l.startswith("{")]
        values += [s[key] for s in steps[2:]]
    return statistics.median(values)
print(f"{'compile':8} {'step s':>8} {'kernels':>8} {'fused':>6}")
for mode in ("off", "on"):
    print(f"{mode:8} {median(mode, 'step_time_s'):8.3f} {median(mode, 'kernels'):8.0f} "
          f"{median(mode, 'fused_kernels'):6.0f}")
print(f"on / off: step {median('on', 'step_time_s') / median('off', 'step_time_s'):.2f}, "
      f"kernels {median('on', 'kernels') / median('off', 'kernels'):.2f}")
PY
