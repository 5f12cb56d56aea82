"""Writes the small tokenizer and text/SFT/chat data under tests/data/ that the trainer's data
tests use (`pip install tokenizers jinja2`; run from the repository root). Deterministic: the
committed files are this script's output.

- tokenizer.json: a GPT-2 style byte-level BPE (ByteLevel pre-tokenizer, so loading it needs
  the `tokenizers` crate's regex), 320 ids, trained on text.txt, with the specials <s>, </s>,
  <pad>, <|im_start|>, <|im_end|>.
- tokenizer_config.json: bos/eos/pad (eos as a {"content": ...} object, as Llama's configs
  write it) and a ChatML chat_template.
- text.txt, text.jsonl ({"text"}), sft.jsonl ({"prompt", "completion"}, completions of
  different lengths), chat.jsonl ({"messages"}).
"""

import json
import os

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = "tests/data"
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = (
    "the model reads a token and predicts the next one while the optimizer moves every "
    "weight a little toward a lower loss ; shards of the weights live on different ranks "
    "and are gathered for each layer , then freed again after the layer has run . "
).split()


def sentences(n, seed):
    out, x = [], seed
    for _ in range(n):
        words = []
        for _ in range(6 + x % 9):
            x = (x * 1103515245 + 12345) % (1 << 31)
            words.append(WORDS[x % len(WORDS)])
        out.append(" ".join(words).capitalize() + ".")
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    text = "\n".join(sentences(60, 7)) + "\n"
    with open(f"{OUT}/text.txt", "w") as f:
        f.write(text)
    with open(f"{OUT}/text.jsonl", "w") as f:
        for s in sentences(16, 11):
            f.write(json.dumps({"text": s}) + "\n")
    with open(f"{OUT}/sft.jsonl", "w") as f:
        for i, s in enumerate(sentences(12, 23)):
            words = s.split()
            # Completions from one word to most of the sentence: different token counts per row.
            cut = 2 + i % 4
            f.write(json.dumps({"prompt": " ".join(words[:cut]),
                                "completion": " " + " ".join(words[cut:cut + 1 + (i * 3) % 9])}) + "\n")
    with open(f"{OUT}/chat.jsonl", "w") as f:
        for i, s in enumerate(sentences(8, 31)):
            words = s.split()
            messages = [{"role": "system", "content": "Answer briefly."}] if i % 2 == 0 else []
            messages += [
                {"role": "user", "content": " ".join(words[:3])},
                {"role": "assistant", "content": " ".join(words[3:6])},
            ]
            if i % 3 == 0:
                messages += [
                    {"role": "user", "content": "And then?"},
                    {"role": "assistant", "content": " ".join(words[6:])},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.save(f"{OUT}/tokenizer.json")
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "pad_token": "<pad>",
        "chat_template": TEMPLATE,
    }
    with open(f"{OUT}/tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    # The rendered text of chat.jsonl's first record, which tests/it/data_chat.rs expects.
    with open(f"{OUT}/chat.jsonl") as f:
        first = json.loads(f.readline())
    rendered = jinja2.Template(TEMPLATE).render(messages=first["messages"], bos_token="<s>",
                                                eos_token="</s>", add_generation_prompt=False)
    # What Hugging Face's Python tokenizer gives, for the Rust side to match: the first SFT
    # example (bos + prompt + completion + eos, each part encoded on its own), the first 40 ids
    # of text.txt and the first chat record's rendered text and ids.
    with open(f"{OUT}/sft.jsonl") as f:
        sft = json.loads(f.readline())
    ids = lambda s: tok.encode(s, add_special_tokens=False).ids
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    expected = {
        "sft_first": [bos] + ids(sft["prompt"]) + ids(sft["completion"]) + [eos],
        "sft_first_prompt_len": 1 + len(ids(sft["prompt"])),
        "text_first_40": ids(text)[:40],
        "chat_first_rendered": rendered,
        "chat_first_ids": ids(rendered),
    }
    with open(f"{OUT}/expected.json", "w") as f:
        json.dump(expected, f)
        f.write("\n")


if __name__ == "__main__":
    main()
