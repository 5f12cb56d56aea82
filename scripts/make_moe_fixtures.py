#!/usr/bin/env python3
"""Writes the tiny Hugging Face mixture-of-experts fixtures (Qwen3-MoE, Mixtral) that the Rust
tests compare against.

Generated with torch 2.15.0 and transformers 4.57.6 (safetensors 0.8.0), CPU, in a venv:

    python3 -m venv /tmp/moe-venv
    /tmp/moe-venv/bin/pip install "transformers==4.57.*" safetensors torch
    /tmp/moe-venv/bin/python scripts/make_moe_fixtures.py tests/fixtures

transformers 4.x is pinned on purpose: its `save_pretrained` writes the Hugging Face hub layout with
one tensor per expert (`model.layers.0.mlp.experts.3.gate_proj.weight`,
`model.layers.0.block_sparse_moe.experts.3.w1.weight`), which is what real checkpoints on the hub
hold. transformers 5.x holds the experts fused (`experts.gate_up_proj`, 3-D parameters); the
script asserts 4.x and checks that the written file has one tensor per expert and no fused one.
CI does not need any of this: it only reads the committed files.

Each fixture directory holds what `save_pretrained` writes (config.json, model.safetensors, f32,
one file) and `logits.json`:
- "ids": [2, 9] token ids; "shape": [2, 9, vocab]; "logits": flattened f32 `model(ids).logits`;
- "router_logits": one entry per sparse layer (in layer order), each the flattened
  [batch * seq, num_experts] router logits (token-major: batch 0's 9 tokens first);
- "aux_loss": `outputs.aux_loss` (load_balancing_loss_func over those router logits, no
  attention mask), "router_aux_loss_coef": the config's coefficient;
- "loss": causal LM loss with labels = ids (transformers shifts internally, mean over the
  2 * 8 predicted tokens), "loss_with_aux": `outputs.loss` with output_router_logits=True, which
  is loss + router_aux_loss_coef * aux_loss (checked here).

Fixtures (eager attention, all weights randn * 0.3, norm weights 1 + 0.2 * randn):
- `qwen3_moe/norm`: Qwen3MoeForCausalLM, vocab 101, hidden 24, 3 layers, 4 heads of 6 over 2 kv
  heads, 8 experts of 14 (top-2, norm_topk_prob true), decoder_sparse_step 1, mlp_only_layers [1]
  (layer 1 is a dense MLP of 40), untied LM head. Sparse layers: 0, 2.
- `qwen3_moe/nonorm`: same shapes, norm_topk_prob false, decoder_sparse_step 2,
  mlp_only_layers [] (only layer 1 is sparse), tied embeddings, router_aux_loss_coef 0.01
  (not the 0.001 default, so a reader that ignores the key fails).
- `mixtral/base`: MixtralForCausalLM, vocab 97, hidden 24, 2 layers, 4 heads of 6 over 1 kv head,
  6 experts of 18 (top-2), rope_theta 1e6, rms_norm_eps 1e-5, sliding_window null, untied.
"""

import json
import os
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

QWEN = dict(
    vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=6, moe_intermediate_size=14,
    num_experts=8, num_experts_per_tok=2, rope_theta=10000.0, rms_norm_eps=1e-6,
    use_sliding_window=False, max_position_embeddings=64,
)

FIXTURES = {
    "qwen3_moe/norm": (Qwen3MoeConfig, Qwen3MoeForCausalLM, 0, dict(
        QWEN, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        tie_word_embeddings=False,
    )),
    "qwen3_moe/nonorm": (Qwen3MoeConfig, Qwen3MoeForCausalLM, 1, dict(
        QWEN, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
        tie_word_embeddings=True, router_aux_loss_coef=0.01,
    )),
    "mixtral/base": (MixtralConfig, MixtralForCausalLM, 2, dict(
        vocab_size=97, hidden_size=24, intermediate_size=18, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=6, num_local_experts=6,
        num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False, max_position_embeddings=64,
    )),
}

SEQ = 9


def reference_aux_loss(router_logits, num_experts, top_k):
    """load_balancing_loss_func without attention mask, written out (cross-check of the notes)."""
    cat = torch.cat(router_logits, dim=0)                        # [layers * tokens, E]
    probs = torch.softmax(cat, dim=-1)
    _, sel = torch.topk(probs, top_k, dim=-1)                    # [N, k]
    mask = torch.nn.functional.one_hot(sel, num_experts).float()  # [N, k, E]
    tokens_per_expert = mask.mean(dim=0)                         # [k, E]
    prob_per_expert = probs.mean(dim=0)                          # [E]
    return (tokens_per_expert * prob_per_expert[None]).sum() * num_experts


def main(out_root):
    assert transformers.__version__.startswith("4."), (
        f"transformers {transformers.__version__}: need 4.x for the per-expert hub layout")
    for name, (config_cls, model_cls, seed, kwargs) in FIXTURES.items():
        torch.manual_seed(seed)
        config = config_cls(**kwargs)
        config._attn_implementation = "eager"
        model = model_cls(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                # Larger than the 0.02 init so that every op visibly matters; norms off 1.
                p.copy_(torch.randn_like(p) * 0.3)
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
        ids = torch.randint(0, config.vocab_size, (2, SEQ),
                            generator=torch.Generator().manual_seed(100 + seed))
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        top_k = config.num_experts_per_tok
        with torch.no_grad():
            logits = model(ids).logits.float()
            plain = model(ids, labels=ids, output_router_logits=False)
            out = model(ids, labels=ids, output_router_logits=True)
        router = [r.float() for r in out.router_logits]
        assert torch.equal(out.logits, logits) and torch.equal(plain.logits, logits)
        coef = config.router_aux_loss_coef
        assert torch.allclose(out.loss, plain.loss + coef * out.aux_loss, rtol=0, atol=1e-6), (
            out.loss, plain.loss, out.aux_loss)
        ref = reference_aux_loss(router, num_experts, top_k)
        assert torch.allclose(ref, out.aux_loss, rtol=1e-6, atol=1e-7), (ref, out.aux_loss)
        # Top-k selection must not hinge on rounding: the k-th and (k+1)-th router
        # probabilities of every token are well apart.
        gaps = []
        for r in router:
            s = torch.softmax(r, dim=-1).sort(dim=-1, descending=True).values
            gaps.append((s[:, top_k - 1] - s[:, top_k]).min().item())
        assert min(gaps) > 1e-4, (name, gaps)

        d = os.path.join(out_root, name)
        shutil.rmtree(d, ignore_errors=True)  # start clean: the directory holds only our files
        os.makedirs(d)
        model.save_pretrained(d, safe_serialization=True)
        os.chmod(os.path.join(d, "model.safetensors"), 0o644)
        for extra in ("generation_config.json",):
            path = os.path.join(d, extra)
            if os.path.exists(path):
                os.remove(path)
        files = sorted(os.listdir(d))
        assert files == ["config.json", "model.safetensors"], files
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            keys = list(f.keys())
            assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
        assert not any("gate_up_proj" in k for k in keys), "fused experts on disk"
        expert_key = ("model.layers.{}.mlp.experts.{}.gate_proj.weight" if "qwen" in name
                      else "model.layers.{}.block_sparse_moe.experts.{}.w1.weight")
        assert sum(expert_key.format(i, e) in keys
                   for i in range(config.num_hidden_layers)
                   for e in range(num_experts)) == len(router) * num_experts
        assert ("lm_head.weight" in keys) == (not config.tie_word_embeddings)

        # The saved directory reproduces the same logits.
        again = model_cls.from_pretrained(d, attn_implementation="eager").eval()
        with torch.no_grad():
            diff = (again(ids).logits - logits).abs().max().item()
            assert diff < 1e-5, diff  # same weights; differs by about 1 ulp (2.4e-7) at most

        with open(os.path.join(d, "logits.json"), "w") as f:
            json.dump({
                "ids": ids.tolist(),
                "shape": list(logits.shape),
                "logits": [round(x, 7) for x in logits.flatten().tolist()],
                "router_logits": [[round(x, 7) for x in r.flatten().tolist()] for r in router],
                "aux_loss": out.aux_loss.item(),
                "router_aux_loss_coef": coef,
                "loss": plain.loss.item(),
                "loss_with_aux": out.loss.item(),
            }, f)
        sparse = [i for i, layer in enumerate(model.model.layers)
                  if hasattr(getattr(layer, "mlp", None), "gate")
                  or hasattr(layer, "block_sparse_moe")]
        assert len(sparse) == len(router)
        print(name, files + ["logits.json"], f"sparse layers {sparse}",
              f"loss {plain.loss.item():.6f} aux {out.aux_loss.item():.6f}",
              f"with aux {out.loss.item():.6f}", f"min top-k gap {min(gaps):.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures")
