#!/usr/bin/env python3
"""Writes tests/fixtures/families/phi3_lora: a peft LoRA adapter on the tiny Phi-3 fixture
(tests/fixtures/families/phi3) that adapts its fused projections as peft does, one module each:
qkv_proj (one lora_A over q, k and v; lora_B's rows q, then k, then v), o_proj, gate_up_proj
and down_proj; r = 2, lora_alpha = 6. lora_B is drawn non-zero (init_lora_weights=False) so
that the adapter changes the logits.

Writes what `save_pretrained` writes for the adapter (adapter_config.json,
adapter_model.safetensors) and `logits.json`: the adapted model's float32 logits for the phi3
fixture's token ids (eager attention), and `grads.safetensors`: the gradient of every
lora_A / lora_B of the mean next-token cross-entropy over those ids (position t predicts
id t + 1), under peft's tensor names.

Needs torch, transformers, peft and safetensors (`pip install torch transformers peft
safetensors`); CI does not: it only reads the committed files.

    python3 scripts/make_phi3_lora_fixture.py [tests/fixtures/families]
"""

import json
import os
import sys

import peft
import torch
import transformers
from safetensors.torch import save_file


def main(fixtures):
    base_dir = os.path.join(fixtures, "phi3")
    out = os.path.join(fixtures, "phi3_lora")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation="eager", dtype=torch.float32)
    config = peft.LoraConfig(
        r=2, lora_alpha=6, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    model = peft.get_peft_model(model, config)
    ids = torch.tensor(json.load(open(os.path.join(base_dir, "logits.json")))["ids"])
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    # Named as the adapter file names them (no adapter name in the key).
    grads = {n.replace(".default", ""): p.grad.contiguous()
             for n, p in model.named_parameters() if p.grad is not None}
    save_file(grads, os.path.join(out, "grads.safetensors"))
    with open(os.path.join(out, "logits.json"), "w") as f:
        json.dump({"ids": ids.tolist(), "shape": list(logits.shape),
                   "loss": loss.item(),
                   "logits": [round(x, 7) for x in logits.detach().flatten().tolist()]}, f)
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    print(sorted(os.listdir(out)), len(grads), "gradients, loss", loss.item())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/families")
