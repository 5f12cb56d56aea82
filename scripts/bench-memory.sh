#!/usr/bin/env bash
# Per-rank peak memory of fine-tuning the ~100M Llama (examples/models/llama_95m.json) under
# FSDP2, one MPI process per rank, beside the memory formula's prediction:
#   full    full fine-tuning
#   frozen  the decoder layers frozen (--freeze model.layers): embedding, final norm and head train
#   lora    LoRA r=8 on every projection, the base frozen
#   qlora   the same with the base in NF4 (--lora-quantize nf4)
#   offload full fine-tuning with offload_policy {offload_params: true} (sharded runs only)
# on 1, 2 and 4 ranks, 3 AdamW steps of a global batch of 8 x 128 tokens. Each run's figure is
# the largest rank's peak RSS while training (VmHWM from the first step on).
#
# The prediction, per rank (docs/benchmarks.md, "Memory you can predict"):
#   runtime + state - grads + max(grads, activations) + held x unit
# - runtime: the peak of the same launch (one process, or mpirun) training a 0.1M-parameter model;
# - state: the run's parameters, gradients and optimizer state (peak_model_state_bytes_per_rank),
#   grads: the trainable parameters' f32 gradients on this rank;
# - activations: bytes per token times the rank's tokens. On one device: the slope of LoRA
#   between 4 and 8 rows. Under FSDP: what LoRA fsdp2 x2 at 8 rows leaves after the other
#   terms, so that row is exact by construction and the others are predictions.
#   Gradients arrive as backward frees activations, so the peak holds the larger;
# - held: the gathered units a rank holds at once under FSDP, max(forward, backward prefetch
#   depth) + 1, and none on one device; unit: the largest unit as gathered (a decoder layer in
#   f32, or its packed NF4 bytes).
#
# Usage: scripts/bench-memory.sh [--ranks "1 2 4"] [--kinds "full frozen lora qlora offload"]
#        [--backward-prefetch D]   (fsdp2_backward_prefetch_depth; default the trainer's, 2)
# The model is the config's seeded init, saved once as a Hugging Face checkpoint into
# target/bench-memory/llama_95m and loaded lazily (each rank reads only its shard, as a real
# fine-tune loads its base). Builds `train_llama` in release with --features mpi first unless
# TRAIN_LLAMA names a binary. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="1 2 4"
kinds="full frozen lora qlora offload"
prefetch=2
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --kinds) kinds="$2"; shift 2 ;;
    --backward-prefetch) prefetch="$2"; shift 2 ;;
    *) echo "unknown argument $1 (usage: $0 [--ranks \"1 2 4\"] [--kinds \"full frozen lora qlora offload\"] [--backward-prefetch D])" >&2; exit 2 ;;
  esac
done

source scripts/bench-95m.sh
work=target/bench-memory
mkdir -p "$work"
printf 'fsdp2_backward_prefetch_depth: %s\n' "$prefetch" > "$work/sharded.yaml"
printf 'fsdp2_backward_prefetch_depth: %s\noffload_policy:\n  offload_params: true\n' \
  "$prefetch" > "$work/offload.yaml"

# run NAME RANKS ARGS...: one training run, its step lines in $work/NAME.jsonl.
run() {
  local name=$1 n=$2
  shift 2
  if [ "$n" = 1 ]; then
    "$bin" "$@" --strategy single --world-size 1 --json > "$work/$name.jsonl" 2> "$work/$name.log"
  else
    mpirun --allow-run-as-root --oversubscribe -np "$n" "$bin" "$@" --engine mpi \
      --strategy fsdp2 --world-size "$n" --json > "$work/$name.jsonl" 2> "$work/$name.log"
  fi
}

common=(--checkpoint "$model" --steps 3 --seq-len 128 --optimizer adamw)
lora=(--lora-rank 8 --lora-alpha 16)
# The formula's measured terms: the runtime of each launch, activation bytes per token.
tiny=(--config examples/models/llama_tiny_chat.json --steps 3 --global-batch 4 --seq-len 8
  --optimizer adamw)
for n in $(echo 1 2 $ranks | tr ' ' '\n' | sort -un); do
  run "runtime-$n" "$n" "${tiny[@]}" --distributed-config "$work/sharded.yaml"
done
run act-4 1 "${common[@]}" "${lora[@]}" --global-batch 4
run act-8 1 "${common[@]}" "${lora[@]}" --global-batch 8
run act-fsdp 2 "${common[@]}" "${lora[@]}" --global-batch 8 --distributed-config "$work/sharded.yaml"

for kind in $kinds; do
  extra=()
  case "$kind" in
    full) ;;
    frozen) extra=(--freeze model.layers) ;;
    lora) extra=("${lora[@]}") ;;
    qlora) extra=("${lora[@]}" --lora-quantize nf4) ;;
    offload) ;;
    *) echo "unknown kind $kind (full, frozen, lora, qlora, offload)" >&2; exit 2 ;;
  esac
  for n in $ranks; do
    conf="$work/sharded.yaml"
    if [ "$kind" = offload ]; then
      [ "$n" = 1 ] && continue
      conf="$work/offload.yaml"
    fi
    if [ "$kind" = lora ] && { [ "$n" = 1 ] || [ "$n" = 2 ]; }; then
      cp "$work/$([ "$n" = 1 ] && echo act-8 || echo act-fsdp).jsonl" "$work/lora-$n.jsonl"
      continue
    fi
    run "$kind-$n" "$n" "${common[@]}" "${extra[@]}" --global-batch 8 --distributed-config "$conf"
  done
done

python3 - "$work" "$prefetch" "$ranks" "$kinds" <<'PY'
import json, sys
work, depth, ranks, kinds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
MiB = 2**20
cfg = json.load(open("examples/models/llama_95m.json"))

def steps(name):
    return [json.loads(l) for l in open(f"{work}/{name}.jsonl") if l.startswith("{")]

def peak(name):
    return max(r["peak_rss_bytes_per_rank"] for r in steps(name))

h, i = cfg["hidden_size"], cfg["intermediate_size"]
kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
layer = 2 * h * h + 2 * h * kv + 3 * h * i          # the decoder layer's linears
unit = {"f32": (layer + 2 * h) * 4, "nf4": layer * 48 / 64 + 2 * h * 4}
runtime = {n: peak(f"runtime-{n}") for n in ["1", "2"] + ranks}
held = max(1, depth) + 1
fsdp_state = max(r["peak_model_state_bytes_per_rank"] for r in steps("act-fsdp"))
# Per token of one rank: 4 more rows on one device; LoRA fsdp2 x2's 4 rows a rank.
act_per_token = {"one": (peak("act-8") - peak("act-4")) / (4 * 128),
                 "fsdp": (peak("act-fsdp") - runtime["2"] - fsdp_state - held * unit["f32"])
                 / (4 * 128)}
print(f"runtime (0.1M-parameter model): "
      + ", ".join(f"{n} rank(s) {runtime[n] / MiB:.0f} MiB" for n in ranks))
print(f"activations per token: one device {act_per_token['one'] / 1024:.1f} KiB (LoRA, 4 and 8 "
      f"rows), fsdp2 {act_per_token['fsdp'] / 1024:.1f} KiB (LoRA x2, 8 rows)")
print(f"unit: {unit['f32'] / MiB:.1f} MiB in f32, {unit['nf4'] / MiB:.1f} MiB in NF4; "
      f"held under FSDP: {held}\n")

rows = {}
print(f"{'kind':8} {'ranks':>5} {'peak MiB':>9} {'predicted':>9} {'off by':>7} {'state':>7} "
      f"{'grads':>6} {'activ.':>7} {'gathered':>8}")
for kind in kinds:
    for n in ranks:
        name = f"{kind}-{n}"
        try:
            got = steps(name)
        except FileNotFoundError:
            continue
        ranks_n = int(n)
        state = max(r["peak_model_state_bytes_per_rank"] for r in got)
        grads = got[0]["trainable_params"] * 4 / ranks_n
        act = act_per_token["one" if ranks_n == 1 else "fsdp"] * 8 * 128 / ranks_n
        gathered = (0 if ranks_n == 1 else held) * unit["nf4" if kind == "qlora" else "f32"]
        predicted = runtime[n] + state - grads + max(grads, act) + gathered
        measured = peak(name)
        rows[name] = measured
        print(f"{kind:8} {n:>5} {measured / MiB:9.0f} {predicted / MiB:9.0f} "
              f"{(measured / predicted - 1) * 100:+6.1f}% {state / MiB:7.0f} {grads / MiB:6.0f} "
              f"{act / MiB:7.0f} {gathered / MiB:8.0f}")

def ratio(a, b, goal):
    if a in rows and b in rows:
        print(f"{a} / {b}: {rows[a] / rows[b]:.2f} (goal <= {goal})")
last = ranks[-1]
print()
ratio(f"lora-{last}", "lora-1", 0.5)
ratio(f"lora-{last}", f"full-{last}", 0.75)
ratio(f"full-{last}", "full-1", 0.4)
ratio(f"qlora-{last}", f"lora-{last}", 0.6)
PY
