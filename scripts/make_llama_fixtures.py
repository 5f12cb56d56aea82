#!/usr/bin/env python3
"""Writes the tiny Hugging Face Llama fixtures that tests/it/llama_hf.rs compares against.

Needs torch, transformers (4.x or 5.x) and safetensors (`pip install torch transformers
safetensors`); CI does not: it only reads the committed files under tests/fixtures/llama/.

    python3 scripts/make_llama_fixtures.py tests/fixtures/llama

Each fixture directory holds what `save_pretrained` writes (config.json, safetensors) and
`logits.json`: fixed token ids and the float32 logits LlamaForCausalLM computes for them.
- `untied`: GQA (5 heads of 6 dims over 1 kv head), hidden 25 and intermediate 37 (divisible by none
  of 2, 3, 4), vocab 101, untied LM head, f32, one safetensors file.
- `tied`: tied embeddings, attention and MLP biases, GQA (7 heads over 1), hidden 35,
  vocab 97, stored in bf16 and
  sharded into several files with an index (weights rounded to bf16 before the logits are
  computed in f32, so the file holds exactly the weights used).
"""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXTURES = {
    "untied": dict(
        vocab_size=101, hidden_size=25, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=1, head_dim=6, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
    ),
    "tied": dict(
        vocab_size=97, hidden_size=35, intermediate_size=41, num_hidden_layers=2,
        num_attention_heads=7, num_key_value_heads=1, head_dim=4, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        max_position_embeddings=64,
    ),
}


def main(out_dir):
    torch.manual_seed(0)
    for name, kwargs in FIXTURES.items():
        config = LlamaConfig(**kwargs)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                # Larger than the 0.02 init so that every op visibly matters; norms off 1.
                p.copy_(torch.randn_like(p) * 0.3)
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
            if name == "tied":
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
        ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(ids).logits.float()
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        if name == "tied":
            model.to(torch.bfloat16).save_pretrained(d, max_shard_size="20KB")
        else:
            model.save_pretrained(d)
        for extra in ("generation_config.json",):
            path = os.path.join(d, extra)
            if os.path.exists(path):
                os.remove(path)
        with open(os.path.join(d, "logits.json"), "w") as f:
            json.dump({"ids": ids.tolist(), "shape": list(logits.shape),
                       "logits": [round(x, 7) for x in logits.flatten().tolist()]}, f)
        print(name, sorted(os.listdir(d)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/llama")
