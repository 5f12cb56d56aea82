#!/usr/bin/env bash
# Megatron-FSDP (flat buffers) against FSDP2 and one device, on the tiny Llama and on a
# ~100M-parameter config (hidden 1024, 8 layers), on 2 and 4 ranks, in one run: median step
# time, collective calls per step (all-gathers + reduce-scatters + all-reduces of rank 0),
# peak model state per rank (parameters, gathered weights, gradients, optimizer state) and peak
# RSS of the process, with the ratios to fsdp2 on the same ranks and to single.
#
# Usage: scripts/bench-megatron.sh [--models "tiny large"] [--steps-tiny N] [--steps-large N]
#   --models LIST    which models, from: tiny (the built-in tiny Llama, global batch 8 x 64
#                    tokens) and large (examples/models/llama_95m.json, 4 x 128); default both
#   --steps-tiny N   steps per tiny run (default 12; the first two are left out of the figures)
#   --steps-large N  steps per large run (default 4; the first is left out)
# Runs per model: single; fsdp2, megatron_fsdp (one collective per layer) and megatron_fsdp
# with a bucket of two layers (large) or all layers (tiny), each on 2 and on 4 rank threads.
# AdamW, one thread per rank, flex, resharding after forward (ZeRO-3). Builds `train_llama` in
# release first unless TRAIN_LLAMA names a binary. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

models="tiny large"
steps_tiny=12
steps_large=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models) models="$2"; shift ;;
    --steps-tiny) steps_tiny="$2"; shift ;;
    --steps-large) steps_large="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-megatron: unknown argument '$1' (see --help)" >&2; exit 2 ;;
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

for model in $models; do
  case "$model" in
    # 4 small layers: one bucket holds them all.
    tiny) common=(--steps "$steps_tiny" --global-batch 8 --seq-len 64); bucket=10000000 ;;
    # A layer holds about 11.6M parameters: a bucket of 24M elements holds two.
    large) common=(--config examples/models/llama_95m.json --steps "$steps_large"
                   --global-batch 4 --seq-len 128); bucket=24000000 ;;
    *) echo "bench-megatron: unknown model '$model'" >&2; exit 2 ;;
  esac
  run() {
    local name="$1"; shift
    echo "== $model $name" >&2
    "$bin" "${common[@]}" --json "$@" > "$work/$model-$name.jsonl"
  }
  run single --strategy single --world-size 1
  for w in 2 4; do
    run "fsdp2x$w" --strategy fsdp2 --world-size "$w"
    run "megatronx$w" --strategy megatron_fsdp --world-size "$w"
    run "megatron-bucketx$w" --strategy megatron_fsdp --world-size "$w" --bucket-size "$bucket"
  done
done

python3 - "$work" "$models" <<'PY'
import json, os, statistics, sys
work, models = sys.argv[1], sys.argv[2].split()
names = ["single"] + [f"{n}x{w}" for w in (2, 4) for n in ("fsdp2", "megatron", "megatron-bucket")]
for model in models:
    rows = {}
    for name in names:
        steps = [json.loads(l) for l in open(os.path.join(work, f"{model}-{name}.jsonl")) if l.startswith("{")]
        skip = 2 if model == "tiny" else 1
        timed = steps[skip:] or steps
        med = lambda k: statistics.median(s[k] for s in timed)
        rows[name] = {
            "step": med("step_time_s"),
            "calls": med("all_gather_calls") + med("reduce_scatter_calls") + med("all_reduce_calls"),
            "ag": med("all_gather_calls"), "rs": med("reduce_scatter_calls"), "ar": med("all_reduce_calls"),
            "state": max(s["peak_model_state_bytes_per_rank"] for s in steps) / 2**20,
            "rss": max(s["peak_rss_bytes"] for s in steps) / 2**20,
            "loss": steps[-1]["loss"],
        }
    print(f"\n{model}: median step over the timed steps; calls = all-gather + reduce-scatter + all-reduce")
    print(f"{'run':<20}{'step s':>9}{'calls':>7}{'(ag/rs/ar)':>12}{'state MiB':>11}{'RSS MiB':>9}"
          f"{'/fsdp2':>8}{'/single':>9}{'last loss':>11}")
    for name, r in rows.items():
        world = name.split("x")[-1] if "x" in name else None
        base = rows.get(f"fsdp2x{world}") if world else None
        vs = f"{r['step'] / base['step']:.2f}" if base else "-"
        split = f"{r['ag']:.0f}/{r['rs']:.0f}/{r['ar']:.0f}"
        print(f"{name:<20}{r['step']:>9.3f}{r['calls']:>7.0f}{split:>12}{r['state']:>11.1f}{r['rss']:>9.0f}"
              f"{vs:>8}{r['step'] / rows['single']['step']:>9.2f}{r['loss']:>11.5f}")
PY
