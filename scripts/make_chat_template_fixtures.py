#!/usr/bin/env python3
"""Writes tests/fixtures/families/chat/expected.json: each family's chat template
(tests/fixtures/families/chat/<family>.jinja, in the form the family's tokenizer_config.json
ships: ChatML with a default system turn for Qwen2, Qwen3's namespace and <think> handling,
Mistral's [INST] turns, Gemma's <start_of_turn> with the `model` role and no system turn
(Gemma 3 folds it into the first user turn), Phi-3's <|user|>/<|end|>, OLMo 2's <|user|>
lines) rendered by transformers' `apply_chat_template` on committed conversations, with and
without the generation prompt, or the error the template raises.

Needs transformers (`pip install transformers tokenizers`); CI does not: it only reads the
committed files.

    python3 scripts/make_chat_template_fixtures.py [tests/fixtures/families/chat]
"""

import json
import os
import sys

import transformers

# The special tokens each family's tokenizer_config.json names (None: none).
SPECIAL = {
    "qwen2": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "mistral": ("<s>", "</s>"),
    "gemma2": ("<bos>", "<eos>"),
    "gemma3": ("<bos>", "<eos>"),
    "phi3": ("<s>", "<|endoftext|>"),
    "olmo2": ("<|endoftext|>", "<|endoftext|>"),
}

CHAT = [
    {"role": "user", "content": "  What is 2 + 3?\n"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "20, since 5 x 4 = 20."},
]
SYSTEM = [{"role": "system", "content": "Answer briefly."}] + CHAT


def main(out_dir):
    tokenizer_file = os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                  "tokenizer.json")
    expected = {}
    for family, (bos, eos) in SPECIAL.items():
        template = open(os.path.join(out_dir, family + ".jinja")).read()
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_file=tokenizer_file, bos_token=bos, eos_token=eos)
        tok.chat_template = template
        cases = []
        for name, messages in [("chat", CHAT), ("system", SYSTEM)]:
            for prompt in [False, True]:
                conversation = messages[:-1] if prompt else messages
                case = {"name": name, "messages": conversation, "add_generation_prompt": prompt}
                try:
                    case["text"] = tok.apply_chat_template(
                        conversation, tokenize=False, add_generation_prompt=prompt)
                except Exception as e:  # the template's raise_exception
                    case["error"] = str(e)
                cases.append(case)
        expected[family] = {"bos_token": bos, "eos_token": eos, "cases": cases}
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for family, e in expected.items():
        print(family, [("error" if "error" in c else len(c["text"])) for c in e["cases"]])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/families/chat")
