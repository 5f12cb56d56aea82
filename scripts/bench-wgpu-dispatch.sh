#!/usr/bin/env bash
# Whether compiling Burn's wgpu backend in costs a flex run anything: `train_llama` built in
# release with `--features mpi` and with `--features "mpi wgpu"` (CI's backends), each training
# the hf-3m Llama (examples/models/llama_hf3m.json) on flex as scripts/bench-torch.py does
# (AdamW, clipping at 1.0, a global batch of 8 x 128 tokens, one compute thread per rank), single
# and ddp x2, alternating builds over R rounds (default 3) of 12 steps. Each figure is the median
# step time of steps 3-12 over the rounds; the ratio is with-wgpu / without. No BURN_DEVICE is set: a flex run
# of the trainer touches no other backend (tests/it/default_device.rs).
#
# Usage: scripts/bench-wgpu-dispatch.sh [--rounds R]   (keep the machine otherwise idle)
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    *) echo "unknown argument $1 (usage: $0 [--rounds R])" >&2; exit 2 ;;
  esac
done

work=target/bench-wgpu-dispatch
mkdir -p "$work"
for features in "mpi" "mpi wgpu"; do
  cargo build --release --locked --features "$features" --example train_llama
  cp target/release/examples/train_llama "$work/train_llama-${features// /-}"
done
unset BURN_DEVICE

for round in $(seq "$rounds"); do
  for build in mpi mpi-wgpu; do
    for layout in "single 1" "ddp 2"; do
      set -- $layout
      "$work/train_llama-$build" --json --strategy "$1" --world-size "$2" --steps 12 \
        --global-batch 8 --seq-len 128 --optimizer adamw --lr 3e-4 --grad-clip 1.0 \
        --backend flex --threads-per-rank 1 --config examples/models/llama_hf3m.json \
        > "$work/$build-$1-$round.jsonl" 2> "$work/$build-$1-$round.log"
    done
  done
done

python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def median(build, strategy):
    times = []
    for round in range(1, rounds + 1):
        steps = [json.loads(l) for l in open(f"{work}/{build}-{strategy}-{round}.jsonl")
                 if l.startswith("{")]
        times += [s["step_time_s"] for s in steps[2:]]
    return statistics.median(times)
print(f"{'strategy':8} {'without s':>10} {'with wgpu s':>12} {'ratio':>6}")
for strategy in ("single", "ddp"):
    a, b = median("mpi", strategy), median("mpi-wgpu", strategy)
    print(f"{strategy:8} {a:10.4f} {b:12.4f} {b / a:6.3f}")
PY
