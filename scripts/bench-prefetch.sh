#!/usr/bin/env bash
# FSDP backward prefetch on the ~100M Llama (examples/models/llama_95m.json), one MPI process
# per rank: full fine-tuning and LoRA (r=8 on every projection) under fsdp2 on 2 ranks, with
# fsdp2_backward_prefetch_depth 0, 1 and 2, 4 AdamW steps of a global batch of 8 x 128 tokens.
# Prints, per run, the medians over the steps after the first of rank 0's backward time, the
# all-gather time counted after forward (backward's re-gathers, issued ahead or not, from issue
# to completion), the time backward was blocked on them (in all and per decoder layer), the
# step time and the largest gathered-weights high-water mark of any rank, with the backward
# time's ratio to depth 0. Loss curves must be the same bits at every depth (checked here too).
#
# Usage: scripts/bench-prefetch.sh [--ranks N] [--depths "0 1 2"] [--kinds "full lora"]
# Builds `train_llama` in release with --features mpi first unless TRAIN_LLAMA names a binary.
# The model is loaded lazily from the checkpoint scripts/bench-memory.sh saves (made here if
# missing). Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks=2
depths="0 1 2"
kinds="full lora"
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --depths) depths="$2"; shift 2 ;;
    --kinds) kinds="$2"; shift 2 ;;
    *) echo "unknown argument $1 (usage: $0 [--ranks N] [--depths \"0 1 2\"] [--kinds \"full lora\"])" >&2; exit 2 ;;
  esac
done

source scripts/bench-95m.sh
work=target/bench-prefetch
mkdir -p "$work"

common=(--checkpoint "$model" --steps 4 --global-batch 8 --seq-len 128 --optimizer adamw --json
  --engine mpi --strategy fsdp2 --world-size "$ranks")
layers=$(python3 -c "import json; print(json.load(open('$model/config.json'))['num_hidden_layers'])")
printf '%-5s %-6s %11s %13s %10s %14s %9s %13s %11s\n' kind depth "backward s" "re-gathers s" \
  "blocked s" "per layer ms" "step s" "gathered MiB" "vs depth 0"
for kind in $kinds; do
  extra=()
  [ "$kind" = lora ] && extra=(--lora-rank 8 --lora-alpha 16)
  base=""
  curve0=""
  for depth in $depths; do
    conf="$work/depth-$depth.yaml"
    printf 'fsdp2_backward_prefetch_depth: %s\n' "$depth" > "$conf"
    out="$work/$kind-$depth.jsonl"
    mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$bin" "${common[@]}" "${extra[@]}" \
      --distributed-config "$conf" > "$out" 2> "$work/$kind-$depth.log"
    read -r bwd gat blocked per_layer step peak curve < <(python3 - "$out" "$layers" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
later = rows[1:] or rows
med = lambda f: statistics.median(f(r) for r in later)
blocked = med(lambda r: r.get('all_gather_backward_wait_s') or 0.0)
print(f"{med(lambda r: r['backward_s']):.3f}",
      f"{med(lambda r: r.get('all_gather_backward_s') or 0.0):.3f}",
      f"{blocked:.3f}", f"{blocked / int(sys.argv[2]) * 1e3:.1f}",
      f"{med(lambda r: r['step_time_s']):.3f}",
      f"{max(r['gathered_peak_bytes_per_rank'] for r in rows) / 2**20:.1f}",
      ",".join(str(r['loss']) for r in rows))
PY
)
    [ -z "$base" ] && base=$bwd && curve0=$curve
    if [ "$curve" != "$curve0" ]; then
      echo "error: $kind depth $depth computed other losses ($curve) than depth 0 ($curve0)" >&2
      exit 1
    fi
    ratio=$(python3 -c "print(f'{$bwd / $base:.2f}')")
    printf '%-5s %-6s %11s %13s %10s %14s %9s %13s %11s\n' "$kind" "$depth" "$bwd" "$gat" \
      "$blocked" "$per_layer" "$step" "$peak" "$ratio"
  done
done
