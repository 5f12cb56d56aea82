#!/usr/bin/env bash
# FSDP at ~100M parameters: step time, where it goes, page faults and peak RSS, for single,
# ddp x2, fsdp2 x2 (threads engine and MPI processes) and fsdp2 x4 on one config, in one run.
#
# Usage: scripts/bench-large.sh [--steps N] [--config FILE] [--runs "single ddp2 ..."]
#   --steps N      steps per run (default 4; the first is left out of the figures)
#   --config FILE  a Hugging Face config.json (default examples/models/llama_95m.json)
#   --runs LIST    which runs, from: single ddp2 fsdp2 fsdp2-mpi fsdp2x4 (default: all)
#   --malloc LIST  train_llama's allocator settings to run each config under, from: kept
#                  (freed pages stay in the process, train_llama's default) and system (the C
#                  library's defaults); default: "system kept"
# Builds `train_llama` in release with the `mpi` feature first (Open MPI and libclang needed
# for the MPI run; leave fsdp2-mpi out of --runs without them, and the build skips the feature),
# unless TRAIN_LLAMA names a binary to run.
# Prints, per run: the median step time over the steps after the first, the time split (forward,
# backward, optimizer; the gathers, reduce-scatters and all-reduces inside them), page faults
# per step, the peak RSS of rank 0's process while training (the model's construction left
# out) next to the model state per rank, and the ratios to single and to ddp x2.
# Batch: global 4 x 128 tokens, AdamW, one thread per rank, flex.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=4
config=examples/models/llama_95m.json
runs="single ddp2 fsdp2 fsdp2-mpi fsdp2x4"
mallocs="system kept"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --config) config="$2"; shift ;;
    --runs) runs="$2"; shift ;;
    --malloc) mallocs="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-large: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -f "$config" ]] || { echo "bench-large: no config file $config" >&2; exit 2; }

bin="${TRAIN_LLAMA:-}"
if [[ -z "$bin" ]]; then
  features=""
  if [[ " $runs " == *" fsdp2-mpi "* ]]; then features="--features mpi"; fi
  # shellcheck disable=SC2086
  cargo build --release --locked $features --example train_llama
  bin="${CARGO_TARGET_DIR:-target}/release/examples/train_llama"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

common=(--config "$config" --steps "$steps" --global-batch 4 --seq-len 128 --json)
run_one() {
  local name="$1" malloc="$2"
  local out="$work/$name-$malloc.jsonl" args=("${common[@]}" --malloc "$malloc")
  echo "== $name ($malloc malloc)" >&2
  case "$name" in
    single) "$bin" "${args[@]}" --strategy single --world-size 1 > "$out" ;;
    ddp2) "$bin" "${args[@]}" --strategy ddp --world-size 2 > "$out" ;;
    fsdp2) "$bin" "${args[@]}" --strategy fsdp2 --world-size 2 > "$out" ;;
    fsdp2x4) "$bin" "${args[@]}" --strategy fsdp2 --world-size 4 > "$out" ;;
    fsdp2-mpi)
      mpirun --allow-run-as-root --oversubscribe -np 2 \
        "$bin" "${args[@]}" --strategy fsdp2 --world-size 2 --engine mpi > "$out" ;;
    *) echo "bench-large: unknown run '$name'" >&2; exit 2 ;;
  esac
}

for malloc in $mallocs; do
  for name in $runs; do run_one "$name" "$malloc"; done
done

python3 - "$work" "$runs" "$mallocs" <<'PY'
import json, statistics, sys, os
work, runs, mallocs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def load(name, malloc):
    steps = [json.loads(l) for l in open(os.path.join(work, f"{name}-{malloc}.jsonl")) if l.startswith("{")]
    timed = steps[1:] or steps
    med = lambda k: statistics.median(s[k] for s in timed)
    return {
        "step": med("step_time_s"), "fwd": med("forward_s"), "bwd": med("backward_s"),
        "opt": med("optimizer_s"), "ag": med("all_gather_s"), "rs": med("reduce_scatter_s"),
        "ar": med("all_reduce_s"), "faults": med("minor_faults"),
        "rss": max(s["peak_rss_bytes"] for s in steps) / 2**20,
        "state": max(s["peak_model_state_bytes_per_rank"] for s in steps) / 2**20,
    }
rows = {(n, m): load(n, m) for m in mallocs for n in runs}
print(f"{'run':<11}{'malloc':<9}{'step s':>8}{'fwd':>7}{'bwd':>7}{'opt':>7}{'gather':>8}{'r-scat':>8}"
      f"{'a-red':>7}{'faults/step':>13}{'peak RSS MiB':>14}{'state MiB':>11}{'/single':>9}{'/ddp2':>7}")
for (n, m), r in rows.items():
    single = rows.get(("single", m), {}).get("step")
    ddp = rows.get(("ddp2", m), {}).get("step")
    ratio = lambda base: f"{r['step'] / base:.2f}" if base else "-"
    print(f"{n:<11}{m:<9}{r['step']:>8.2f}{r['fwd']:>7.2f}{r['bwd']:>7.2f}{r['opt']:>7.2f}"
          f"{r['ag']:>8.2f}{r['rs']:>8.2f}{r['ar']:>7.2f}{r['faults']:>13.0f}{r['rss']:>14.0f}{r['state']:>11.0f}"
          f"{ratio(single):>9}{ratio(ddp):>7}")
PY
