#!/usr/bin/env bash
# The LibTorch lane, run by hand: every strategy on `--backend tch` (LibTorch on the CPU, rank
# threads sharing it) against the same run on flex, and checkpoints that resume across the two.
#
# Each case trains the built-in tiny Llama for 5 AdamW steps (global batch 8 x 32 tokens) on
# both backends: the loss of every step must agree within 1e-5 and the saved weights (the
# Hugging Face save, or the LoRA adapter) within 1e-4 per element. AdamW divides each
# element's step by its own gradient's size, so two backends' kernels, which round in other
# orders, move elements whose gradient is near zero differently: ndarray against flex, both
# f32 on the CPU, part by up to 3.7e-5 in the weights while their losses agree to 7e-7. Then
# a checkpoint saved by tch at step 3 resumes on flex to step 5, and one saved by flex resumes
# on tch, both against the straight flex run. Prints a PASS/FAIL line per check and exits 1 if any failed.
#
# Needs a train_llama built with `--features tch` and LibTorch (scripts/libtorch.sh):
#   scripts/libtorch.sh install
#   CARGO_TARGET_DIR=target-tch scripts/libtorch.sh build --release --features tch --example train_llama
# (`build`, not `run cargo build`: it patches burn-dispatch's missing LibTorch arm of
# grad_replace, without which every strategy that replaces gradients panics on tch)
#   TRAIN_LLAMA=target-tch/release/examples/train_llama scripts/tch-lane.sh
# (a separate target folder: the tch feature changes Burn's features, so sharing one would
# rebuild Burn each time you switch). Environment: TRAIN_LLAMA, TCH_LANE_WORK (kept; default a
# temporary folder removed at the end), TCH_LANE_BACKEND (default tch: the backend compared
# with flex).
set -euo pipefail
cd "$(dirname "$0")/.."

train="${TRAIN_LLAMA:-target/release/examples/train_llama}"
backend="${TCH_LANE_BACKEND:-tch}"
[[ -x "$train" ]] || { echo "tch-lane: no train_llama at $train (set TRAIN_LLAMA)" >&2; exit 2; }
if [[ -n "${TCH_LANE_WORK:-}" ]]; then
  work="$TCH_LANE_WORK"; mkdir -p "$work"
else
  work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
fi
if [[ "$backend" == tch ]]; then
  eval "$(scripts/libtorch.sh env)"
fi

TOL=1e-5
TOL_WEIGHTS=1e-4
failed=0
common=(--engine threads --steps 5 --global-batch 8 --seq-len 32 --optimizer adamw --json)

result() {
  printf '%-6s %s\n' "$1" "$2"
  [[ "$1" == PASS ]] || failed=$((failed + 1))
}

# train NAME BACKEND ARGS...: one run, JSON per step in NAME.json, stderr in NAME.err.
train() {
  local name="$1" be="$2"
  shift 2
  if ! "$train" "${common[@]}" --backend "$be" "$@" >"$work/$name.json" 2>"$work/$name.err"; then
    echo "   $name failed:"; tail -n 5 "$work/$name.err" | sed 's/^/   | /'
    return 1
  fi
}

# compare LABEL A B [DIR_A DIR_B]: loss curves (and safetensors files under the dirs).
compare() {
  local verdict
  verdict="$(python3 - "$TOL" "$TOL_WEIGHTS" "$work/$2.json" "$work/$3.json" "${4:-}" "${5:-}" <<'PY'
import json, pathlib, struct, sys
from array import array

tol, tol_weights = float(sys.argv[1]), float(sys.argv[2])
def fail(message):
    print(f"FAIL {message}")
    sys.exit(1)
def losses(path):
    return [json.loads(l)["loss"] for l in open(path) if l.startswith("{")]
def tensors(folder):
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] != "F32":
                fail(f"{f.name}:{name} is {meta['dtype']}, expected F32")
            a, b = meta["data_offsets"]
            values = array("f")
            values.frombytes(raw[8 + n + a:8 + n + b])
            out[f"{f.name}:{name}"] = values
    return out
a, b = losses(sys.argv[3]), losses(sys.argv[4])
if len(a) != len(b) or not a:
    fail(f"{len(a)} and {len(b)} steps")
worst = max(abs(x - y) for x, y in zip(a, b))
detail = f"losses within {worst:.1e}"
if worst > tol:
    fail(f"{detail} (tolerance {tol})")
if sys.argv[5]:
    ta, tb = tensors(sys.argv[5]), tensors(sys.argv[6])
    if not ta or ta.keys() != tb.keys():
        fail(f"the saved tensors differ: {sorted(ta)[:3]} against {sorted(tb)[:3]}")
    w = max(max((abs(x - y) for x, y in zip(ta[k], tb[k])), default=0.0) for k in ta)
    detail += f", {len(ta)} saved tensors within {w:.1e}"
    if w > tol_weights:
        fail(f"{detail} (tolerance {tol_weights})")
print(f"PASS {detail}")
PY
)" || true
  [[ -n "$verdict" ]] || verdict="FAIL the comparison did not run"
  result "${verdict%% *}" "$1: ${verdict#* }"
}

# case LABEL ARGS...: the run on both backends, losses and saved weights compared.
case_() {
  local label="$1" key
  shift
  key="$(echo "$label" | tr -c 'a-z0-9\n' '_')"
  local save=(--save "$work/$key-flex.save")
  local save_b=(--save "$work/$key-$backend.save")
  if [[ " $* " == *" --lora-rank "* ]]; then
    save=(--save-adapter "$work/$key-flex.save")
    save_b=(--save-adapter "$work/$key-$backend.save")
  fi
  if train "$key-flex" flex "$@" "${save[@]}" && train "$key-$backend" "$backend" "$@" "${save_b[@]}"; then
    compare "$label, $backend against flex" "$key-flex" "$key-$backend" \
      "$work/$key-flex.save" "$work/$key-$backend.save"
  else
    result FAIL "$label, $backend against flex: a run failed"
  fi
}

echo "tch-lane: $train, $backend against flex, work folder $work"
case_ "single" --strategy single --world-size 1
case_ "ddp x2" --strategy ddp --world-size 2
case_ "fsdp2 x2" --strategy fsdp2 --world-size 2
case_ "tp 2" --strategy tp --world-size 2
case_ "fsdp2_tp 2x2" --strategy fsdp2_tp --world-size 4 --tp 2
case_ "pp 2" --strategy fsdp2 --world-size 2 --pp 2
case_ "lora fsdp2 x2" --strategy fsdp2 --world-size 2 --lora-rank 4 --lora-alpha 8

# Checkpoints across backends: saved at step 3 by one, resumed to step 5 by the other.
resume_case() {
  local from="$1" to="$2" dir="$work/ckpt-$1"
  if train "ckpt-$from" "$from" --strategy fsdp2 --world-size 2 --save-every 3 --save-dir "$dir" &&
    train "resumed-on-$to" "$to" --strategy fsdp2 --world-size 2 --resume "$dir/step-00000003"; then
    # The resumed run logs steps 3 and 4: compare them with the straight flex run's.
    grep '^{' "$work/fsdp2_x2-flex.json" | tail -n +4 >"$work/flex-tail.json" || true
    grep '^{' "$work/resumed-on-$to.json" >"$work/resumed-tail.json" || true
    compare "a $from checkpoint resumed on $to, against flex throughout" flex-tail resumed-tail
  else
    result FAIL "a $from checkpoint resumed on $to: a run failed"
  fi
}
resume_case "$backend" flex
resume_case flex "$backend"

echo "tch-lane: $failed failed"
((failed == 0))
