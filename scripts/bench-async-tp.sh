#!/usr/bin/env bash
# Async tensor parallelism against synchronous sequence-parallel TP, in one command: the ~100M
# Llama (examples/models/llama_95m.json) under tp 2 with the llama-sp plan, one MPI process per
# rank, full fine-tuning, AdamW, a global batch of 4 x 256 tokens. Each mode runs twice,
# alternating (sync, async, sync, async), and each figure is the median over both runs of
# steps 2 to 4:
#   step s    the step time;
#   blocked s the largest rank's time blocked on collectives (rank_wait_s: a blocking call's
#             whole time, of a ring step issued ahead only the wait for its result), the
#             communication the compute did not hide;
#   a2a s     the time in all-to-alls (the ring steps), from issue to completion.
#
# Usage: scripts/bench-async-tp.sh
# Builds `train_llama` in release with --features mpi first unless TRAIN_LLAMA names a binary;
# the base model is the one scripts/bench-memory.sh saves (made here if missing). Keep the
# machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/bench-95m.sh
work=target/bench-async-tp
mkdir -p "$work"
printf 'enable_async_tensor_parallel: false\n' > "$work/sync.yaml"
printf 'enable_async_tensor_parallel: true\n' > "$work/async.yaml"

for round in 1 2; do
  for mode in sync async; do
    mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" --checkpoint "$model" --steps 4 \
      --seq-len 256 --global-batch 4 --optimizer adamw --engine mpi --strategy tp \
      --world-size 2 --tp-plan llama-sp --distributed-config "$work/$mode.yaml" --json \
      > "$work/$mode-$round.jsonl" 2> "$work/$mode-$round.log"
  done
done

python3 - "$work" <<'PY'
import json, statistics, sys
work = sys.argv[1]
def figures(mode):
    steps = []
    for round in (1, 2):
        lines = [json.loads(l) for l in open(f"{work}/{mode}-{round}.jsonl") if l.startswith("{")]
        steps += lines[1:]
    med = lambda f: statistics.median(f(s) for s in steps)
    return (med(lambda s: s["step_time_s"]), med(lambda s: max(s["rank_wait_s"])),
            med(lambda s: s["all_to_all_s"]))
sync, ring = figures("sync"), figures("async")
print(f"{'mode':6} {'step s':>7} {'blocked s':>10} {'a2a s':>6}")
for name, (step, blocked, a2a) in (("sync", sync), ("async", ring)):
    print(f"{name:6} {step:7.2f} {blocked:10.2f} {a2a:6.2f}")
print(f"async / sync: step {ring[0] / sync[0]:.2f}, blocked {ring[1] / sync[1]:.2f}")
PY
