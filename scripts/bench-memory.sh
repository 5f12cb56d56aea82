#!/usr/bin/env bash
# Per-rank peak memory of fine-tuning the ~100M Llama (examples/models/llama_95m.json) under
# FSDP2, one MPI process per rank: full fine-tuning, LoRA (r=8 on every projection, the base
# frozen) and QLoRA (the same with the base in NF4, --lora-quantize nf4) on 1, 2 and 4 ranks, 3 AdamW steps of a global batch of 8 x 128 tokens. Prints each
# run's largest peak RSS of a rank (VmHWM while training), its model state (parameters,
# gradients, optimizer state) and the ratios the FSDP memory goals are stated in.
#
# Usage: scripts/bench-memory.sh [--ranks "1 2 4"] [--kinds "full lora qlora"]
#        [--backward-prefetch D]   (fsdp2_backward_prefetch_depth; default the trainer's, 2)
# The model is the config's seeded init, saved once as a Hugging Face checkpoint into
# target/bench-memory/llama_95m and loaded lazily (each rank reads only its shard, as a real
# fine-tune loads its base). Builds `train_llama` in release with --features mpi first unless
# TRAIN_LLAMA names a binary. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="1 2 4"
kinds="full lora qlora"
prefetch=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --kinds) kinds="$2"; shift 2 ;;
    --backward-prefetch) prefetch="$2"; shift 2 ;;
    *) echo "unknown argument $1 (usage: $0 [--ranks \"1 2 4\"] [--kinds \"full lora qlora\"] [--backward-prefetch D])" >&2; exit 2 ;;
  esac
done

bin="${TRAIN_LLAMA:-}"
if [ -z "$bin" ]; then
  cargo build --release --features mpi --example train_llama
  bin=target/release/examples/train_llama
fi
work=target/bench-memory
mkdir -p "$work"
model="$work/llama_95m"
if [ ! -f "$model/config.json" ]; then
  "$bin" --config examples/models/llama_95m.json --strategy single --world-size 1 --steps 1 \
    --global-batch 1 --seq-len 8 --optimizer sgd --lr 0 --save "$model" > "$work/save.log"
fi

common=(--checkpoint "$model" --steps 3 --global-batch 8 --seq-len 128 --optimizer adamw)
sharded=()
if [ -n "$prefetch" ]; then
  printf 'fsdp2_backward_prefetch_depth: %s\n' "$prefetch" > "$work/prefetch.yaml"
  sharded=(--distributed-config "$work/prefetch.yaml")
fi
declare -A peak
printf '%-6s %-5s %12s %12s\n' kind ranks "peak MiB" "state MiB"
for kind in $kinds; do
  extra=()
  [ "$kind" = lora ] && extra=(--lora-rank 8 --lora-alpha 16)
  [ "$kind" = qlora ] && extra=(--lora-rank 8 --lora-alpha 16 --lora-quantize nf4)
  for n in $ranks; do
    log="$work/$kind-$n.log"
    if [ "$n" = 1 ]; then
      "$bin" "${common[@]}" "${extra[@]}" --strategy single --world-size 1 > "$log" 2>&1
    else
      mpirun --allow-run-as-root --oversubscribe -np "$n" "$bin" "${common[@]}" "${extra[@]}" \
        --engine mpi --strategy fsdp2 --world-size "$n" "${sharded[@]}" > "$log" 2>&1
    fi
    p=$(grep -o 'peak RSS while training [0-9.]*' "$log" | awk '{print $5}' | sort -n | tail -1)
    s=$(grep -o 'optimizer): [0-9.]* MiB' "$log" | head -1 | awk '{print $2}')
    peak[$kind-$n]=$p
    printf '%-6s %-5s %12s %12s\n' "$kind" "$n" "$p" "$s"
  done
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }
last=${ranks##* }
echo
echo "LoRA x$last / LoRA x1: $(ratio "${peak[lora-$last]:-0}" "${peak[lora-1]:-0}") (goal <= 0.5)"
echo "LoRA x$last / full x$last: $(ratio "${peak[lora-$last]:-0}" "${peak[full-$last]:-0}") (goal <= 0.75)"
echo "full x$last / full x1: $(ratio "${peak[full-$last]:-0}" "${peak[full-1]:-0}") (goal <= 0.4)"
echo "QLoRA x$last / LoRA x$last: $(ratio "${peak[qlora-$last]:-0}" "${peak[lora-$last]:-0}") (goal <= 0.6)"
