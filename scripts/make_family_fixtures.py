#!/usr/bin/env python3
"""Writes the tiny Hugging Face fixtures of the decoder families that tests/it/families_hf.rs
compares against: Qwen2 (q/k/v biases; a sliding window on its second layer), Qwen3 (per-head
q/k norms), Mistral (a sliding window of 3 keys), OLMo 2 (post-norms, whole-projection q/k
norms), Gemma 2 (attention and final logit soft-capping, a window on every other layer) and
Gemma 3 (sandwich norms scaling by 1 + w, scaled embeddings, GeGLU, a local rotary base on its
sliding layers and a scaled global one, query_pre_attn_scalar, tied embeddings) and Phi-3 (q/k/v
fused in qkv_proj and gate/up in gate_up_proj, a sliding window of 4 keys; `phi3_partial`:
half of each head's dims rotating, partial_rotary_factor 0.5, as Phi-4-mini's 0.75).

Needs torch, transformers (4.x or 5.x) and safetensors (`pip install torch transformers
safetensors`); CI does not: it only reads the committed files under tests/fixtures/families/.

    python3 scripts/make_family_fixtures.py tests/fixtures/families [NAME ...]

(only the fixtures NAME when given).

Each fixture directory holds what `save_pretrained` writes (config.json, safetensors) and
`logits.json`: fixed token ids (2 rows of 9) and the float32 logits the model computes for them
(eager attention); and `grads.safetensors`: the gradient of every parameter, by its name, of
the mean next-token cross-entropy over those ids (position t predicts id t + 1).

    python3 scripts/make_family_fixtures.py --grads tests/fixtures/families [NAME ...]

writes only `grads.safetensors`, from the committed checkpoints and ids.
"""

import json
import os
import sys

import torch
import transformers

COMMON = dict(
    vocab_size=61, hidden_size=24, intermediate_size=37, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=64, tie_word_embeddings=False,
)

FIXTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                   rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=3)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0)),
    # Layers 0 and 2 slide over 3 keys; scores capped at 5 and logits at 3 (tanh bends them).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=6, sliding_window=3,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # Layers 0 and 2 slide over 3 keys with the local base; layer 1 is global, its rope scaled.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=6,
                    sliding_window=3, sliding_window_pattern=2, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0,
                    rope_scaling={"rope_type": "linear", "factor": 2.0},
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=4, pad_token_id=0)),
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM",
                     dict(partial_rotary_factor=0.5, pad_token_id=0)),
}


def next_token_loss(model, ids):
    logits = model(ids).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def write_grads(out_dir, names):
    from safetensors.torch import save_file
    for name in FIXTURES:
        if names and name not in names:
            continue
        d = os.path.join(out_dir, name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, attn_implementation="eager", dtype=torch.float32)
        ids = torch.tensor(json.load(open(os.path.join(d, "logits.json")))["ids"])
        next_token_loss(model, ids).backward()
        grads = {n: p.grad.contiguous() for n, p in model.named_parameters()}
        save_file(grads, os.path.join(d, "grads.safetensors"))
        print(name, len(grads), "gradients")


def main(out_dir, names):
    for name, (config_class, model_class, extra) in FIXTURES.items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**{**COMMON, **extra})
        config._attn_implementation = "eager"
        model = getattr(transformers, model_class)(config).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                # Larger than the 0.02 init so that every op visibly matters; norms off 1.
                if "norm" in n:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) * 0.3)
        ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(ids).logits.float()
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        path = os.path.join(d, "generation_config.json")
        if os.path.exists(path):
            os.remove(path)
        with open(os.path.join(d, "logits.json"), "w") as f:
            json.dump({"ids": ids.tolist(), "shape": list(logits.shape),
                       "logits": [round(x, 7) for x in logits.flatten().tolist()]}, f)
        print(name, sorted(os.listdir(d)))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--grads"]:
        write_grads(args[1] if len(args) > 1 else "tests/fixtures/families", args[2:])
    else:
        main(args[0] if args else "tests/fixtures/families", args[1:])
