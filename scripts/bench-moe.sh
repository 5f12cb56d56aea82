#!/usr/bin/env bash
# Expert parallelism on the built-in tiny MoE (a Qwen3-MoE: hidden 64, 4 layers of which 3
# sparse, 8 experts of width 48, top-2), in one run: median tokens per second, the largest
# per-rank model state (parameters, gradients, optimizer state, gathered weights) and the
# all_to_all calls per step, with the ratios to one device.
#
# Usage: scripts/bench-moe.sh [--steps N] [--rounds R]
#   --steps N    steps per run (default 12; the first two are left out of the figures)
#   --rounds R   times each run is repeated, the median of the rounds reported (default 3)
# Runs: single; ep 2 (fsdp2 on 2 ranks, the experts split over both); ep 4 (fsdp2 on 4);
# ep 2 x fsdp2 (4 ranks: the experts split over pairs and FSDP-sharded over the two pairs);
# and for reference fsdp2 x4 without ep (every expert sharded over all 4). AdamW, global batch
# 8 x 64 tokens, one thread per rank, flex. Builds `train_llama` in release first unless
# TRAIN_LLAMA names a binary. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=12
rounds=3
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-moe: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

bin="${TRAIN_LLAMA:-}"
if [[ -z "$bin" ]]; then
  cargo build --release --locked --example train_llama
  bin="${CARGO_TARGET_DIR:-target}/release/examples/train_llama"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

common=(--model tiny-moe --steps "$steps" --global-batch 8 --seq-len 64 --json)
for round in $(seq "$rounds"); do
  run() {
    local name="$1"; shift
    echo "== round $round: $name" >&2
    "$bin" "${common[@]}" "$@" > "$work/$name-$round.jsonl"
  }
  run single --strategy single --world-size 1
  run ep2 --strategy fsdp2 --world-size 2 --ep 2
  run ep4 --strategy fsdp2 --world-size 4 --ep 4
  run ep2-fsdp2 --strategy fsdp2 --world-size 4 --ep 2
  run fsdp2x4 --strategy fsdp2 --world-size 4
done

python3 - "$work" "$rounds" <<'PY'
import json, os, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
names = ["single", "ep2", "ep4", "ep2-fsdp2", "fsdp2x4"]
rows = {}
for name in names:
    per_round = []
    for r in range(1, rounds + 1):
        steps = [json.loads(l) for l in open(os.path.join(work, f"{name}-{r}.jsonl")) if l.startswith("{")]
        timed = steps[2:] or steps
        per_round.append({
            "tok": statistics.median(s["tokens_per_s"] for s in timed),
            "state": max(s["peak_model_state_bytes_per_rank"] for s in steps) / 2**10,
            "a2a": statistics.median(s["all_to_all_calls"] for s in timed),
            "loss": steps[-1]["loss"],
        })
    rows[name] = {k: statistics.median(p[k] for p in per_round) for k in per_round[0]}
print(f"\nmedian over {rounds} rounds of the median step; state = largest per-rank model state")
print(f"{'run':<12}{'tokens/s':>10}{'/single':>9}{'state KiB':>11}{'/single':>9}{'all_to_all':>12}{'last loss':>11}")
for name, r in rows.items():
    s = rows["single"]
    print(f"{name:<12}{r['tok']:>10.0f}{r['tok'] / s['tok']:>9.2f}{r['state']:>11.1f}"
          f"{r['state'] / s['state']:>9.2f}{r['a2a']:>12.0f}{r['loss']:>11.5f}")
PY
