# Sourced by the 95M benchmarks (bench-memory.sh, bench-prefetch.sh, bench-ac-memory.sh): sets
# `bin`, the release `train_llama` with --features mpi (built here unless TRAIN_LLAMA names a
# binary), and `model`, the seeded init of examples/models/llama_95m.json saved once as a
# Hugging Face checkpoint in target/bench-memory/llama_95m, which the runs load lazily (each rank
# reads only its shard, as a real fine-tune loads its base).
bin="${TRAIN_LLAMA:-}"
if [ -z "$bin" ]; then
  cargo build --release --features mpi --example train_llama
  bin=target/release/examples/train_llama
fi
model=target/bench-memory/llama_95m
if [ ! -f "$model/config.json" ]; then
  mkdir -p target/bench-memory
  "$bin" --config examples/models/llama_95m.json --strategy single --world-size 1 --steps 1 \
    --global-batch 1 --seq-len 8 --optimizer sgd --lr 0 --save "$model" \
    > target/bench-memory/save.log
fi
