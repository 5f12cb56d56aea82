#!/usr/bin/env bash
# Step time of each decoder family at the 95M Llama's sizes (examples/models/llama_95m.json:
# hidden 1024, 8 layers, 16 heads of 64, 8 kv heads, intermediate 2752, vocab 1024) under fsdp2
# x2 (rank threads), against the Llama's, in one command; then sliding-window against full
# attention at 2048 tokens on one rank.
#
# Each family's config is its committed fixture (tests/fixtures/families/NAME/config.json, made
# by transformers) with the sizes above, windows of 512 keys and the layer pattern extended to 8
# layers, written to target/bench-families/. Each run: seeded init, AdamW, a global batch of
# 8 x 128 tokens, STEPS steps (default 6); the figure is the median of rank 0's step time over
# the steps after the first. The window run: Mistral's config with and without its window,
# 1 x 2048 tokens, 4 steps, one rank.
#
# Usage: scripts/bench-families.sh [STEPS]
# Builds `train_llama` in release first unless TRAIN_LLAMA names a binary. Keep the machine
# otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."

steps="${1:-6}"
bin="${TRAIN_LLAMA:-}"
if [ -z "$bin" ]; then
  cargo build --release --example train_llama
  bin=target/release/examples/train_llama
fi
work=target/bench-families
mkdir -p "$work"

python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
base = json.load(open("examples/models/llama_95m.json"))
sizes = {k: base[k] for k in ["hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "vocab_size"]}
layers = sizes["num_hidden_layers"]
json.dump(base, open(f"{work}/llama.json", "w"), indent=1)
for name in ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2"]:
    cfg = json.load(open(f"tests/fixtures/families/{name}/config.json"))
    cfg.update(sizes)
    cfg["head_dim"] = sizes["hidden_size"] // sizes["num_attention_heads"]
    cfg["max_position_embeddings"] = 4096
    cfg["pad_token_id"] = 0
    for key in ["bos_token_id", "eos_token_id"]:
        cfg[key] = min(cfg.get(key) or 1, sizes["vocab_size"] - 1)
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 512
    if "query_pre_attn_scalar" in cfg:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    # Qwen's layers slide from max_window_layers on; Gemma's alternate as in the fixture.
    if "max_window_layers" in cfg:
        first = min(cfg["max_window_layers"], layers)
        slides = lambda i: cfg.get("use_sliding_window") and i >= first
        cfg["layer_types"] = ["sliding_attention" if slides(i) else "full_attention"
                              for i in range(layers)]
    elif "layer_types" in cfg:
        pattern = cfg["layer_types"][:2]
        cfg["layer_types"] = [pattern[i % 2] for i in range(layers)]
    json.dump(cfg, open(f"{work}/{name}.json", "w"), indent=1)
    if name == "mistral":
        cfg["sliding_window"] = None
        json.dump(cfg, open(f"{work}/mistral_full.json", "w"), indent=1)
PY

# median_step NAME: rank 0's median step time over the steps after the first.
median_step() {
  python3 - "$work/$1.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{statistics.median(r['step_time_s'] for r in rows[1:]):.3f}")
PY
}

common=(--optimizer adamw --lr 1e-4 --seed 0 --json)
families="llama qwen2 qwen3 mistral gemma2 gemma3 phi3 olmo2"
for f in $families; do
  "$bin" --config "$work/$f.json" --strategy fsdp2 --world-size 2 --steps "$steps" \
    --global-batch 8 --seq-len 128 "${common[@]}" > "$work/$f.jsonl" 2> "$work/$f.log"
done
for w in mistral mistral_full; do
  "$bin" --config "$work/$w.json" --strategy single --world-size 1 --steps 4 \
    --global-batch 1 --seq-len 2048 "${common[@]}" > "$work/window-$w.jsonl" 2> "$work/window-$w.log"
done

llama=$(median_step llama)
printf '%-8s %10s %9s\n' family "step (s)" "/ llama"
for f in $families; do
  t=$(median_step "$f")
  printf '%-8s %10s %9.2f\n' "$f" "$t" "$(python3 -c "print($t / $llama)")"
done
window=$(median_step window-mistral)
full=$(median_step window-mistral_full)
printf '\nseq 2048, one rank: window 512 %ss, full attention %ss, window / full %.2f\n' \
  "$window" "$full" "$(python3 -c "print($window / $full)")"
