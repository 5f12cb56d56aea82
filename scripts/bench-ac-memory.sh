#!/usr/bin/env bash
# Per-rank peak memory and step time of fine-tuning the ~100M Llama
# (examples/models/llama_95m.json) under each activation-checkpointing mode, all in one run:
#   none       activation_checkpointing = false
#   full       every decoder layer recomputed in backward (TorchTitan's "full")
#   every-2    every second layer (mode "selective", selective_ac_option "2")
#   op         selective by op: Burn's checkpointing device (selective_ac_option "op")
# for LoRA r=8 on one device, LoRA under fsdp2 x4 and QLoRA (NF4 base) under fsdp2 x4 (one MPI
# process per rank), 3 AdamW steps of a global batch of 8 x 128 tokens. Each figure is the
# largest rank's peak RSS while training; the step time is the median of steps 2-3.
#
# Usage: scripts/bench-ac-memory.sh [--layouts "lora:1 lora:4 qlora:4"]
# Builds `train_llama` in release with --features mpi first unless TRAIN_LLAMA names a binary;
# the base model is the one scripts/bench-memory.sh saves (made here if missing). Keep the
# machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

layouts="lora:1 lora:4 qlora:4"
while [ $# -gt 0 ]; do
  case "$1" in
    --layouts) layouts="$2"; shift 2 ;;
    *) echo "unknown argument $1 (usage: $0 [--layouts \"lora:1 lora:4 qlora:4\"])" >&2; exit 2 ;;
  esac
done

source scripts/bench-95m.sh
work=target/bench-memory
mkdir -p "$work/ac"
modes="none full every-2 op"
for mode in $modes; do
  case "$mode" in
    none) printf 'activation_checkpointing: false\n' ;;
    full) printf 'activation_checkpointing: true\nactivation_checkpointing_mode: full\n' ;;
    every-2) printf 'activation_checkpointing: true\nactivation_checkpointing_mode: selective\nselective_ac_option: "2"\n' ;;
    op) printf 'activation_checkpointing: true\nactivation_checkpointing_mode: selective\nselective_ac_option: op\n' ;;
  esac > "$work/ac/$mode.yaml"
done

common=(--checkpoint "$model" --steps 3 --seq-len 128 --global-batch 8 --optimizer adamw
  --lora-rank 8 --lora-alpha 16)
for layout in $layouts; do
  kind=${layout%%:*} n=${layout##*:}
  extra=()
  case "$kind" in
    lora) ;;
    qlora) extra=(--lora-quantize nf4) ;;
    *) echo "unknown kind $kind (lora, qlora)" >&2; exit 2 ;;
  esac
  for mode in $modes; do
    out="$work/ac/$kind-$n-$mode"
    args=("${common[@]}" "${extra[@]}" --distributed-config "$work/ac/$mode.yaml" --json)
    if [ "$n" = 1 ]; then
      "$bin" "${args[@]}" --strategy single --world-size 1 > "$out.jsonl" 2> "$out.log"
    else
      mpirun --allow-run-as-root --oversubscribe -np "$n" "$bin" "${args[@]}" --engine mpi \
        --strategy fsdp2 --world-size "$n" > "$out.jsonl" 2> "$out.log"
    fi
  done
done

python3 - "$work/ac" "$layouts" "$modes" <<'PY'
import json, statistics, sys
work, layouts, modes = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
MiB = 2**20
print(f"{'layout':10} {'mode':8} {'peak MiB':>9} {'/ none':>7} {'step s':>7} {'/ none':>7}")
for layout in layouts:
    kind, n = layout.split(":")
    base = None
    for mode in modes:
        steps = [json.loads(l) for l in open(f"{work}/{kind}-{n}-{mode}.jsonl") if l.startswith("{")]
        peak = max(r["peak_rss_bytes_per_rank"] for r in steps)
        time = statistics.median(r["step_time_s"] for r in steps[1:])
        if base is None:
            base = (peak, time)
        print(f"{kind + ' x' + n:10} {mode:8} {peak / MiB:9.0f} {peak / base[0]:7.2f} "
              f"{time:7.2f} {time / base[1]:7.2f}")
PY
