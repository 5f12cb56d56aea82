#!/usr/bin/env python3
"""Writes tests/fixtures/nf4/bnb.json: weights and what bitsandbytes' NF4 makes of them
(`bitsandbytes.functional.quantize_4bit(W, blocksize=64, quant_type="nf4")`): the packed bytes,
the per-block absmax and `dequantize_4bit`'s values, for tests/it/qlora.rs.

Needs torch and bitsandbytes (`pip install torch bitsandbytes`); CI only reads the JSON.

    python3 scripts/make_nf4_fixture.py tests/fixtures/nf4/bnb.json
"""

import json
import sys

import torch
import bitsandbytes.functional as F


def case(name, w):
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    back = F.dequantize_4bit(q, state)
    return {
        "name": name,
        "shape": list(w.shape),
        "values": w.flatten().tolist(),
        "packed": q.flatten().tolist(),
        "absmax": state.absmax.flatten().tolist(),
        "dequantized": back.flatten().tolist(),
    }


def main(path):
    g = torch.Generator().manual_seed(0)
    awkward = torch.randn(20, 10, generator=g) * 0.1
    awkward.view(-1)[64:128] = 0.0  # an all-zero block
    awkward.view(-1)[130] = 1.0e6  # one huge value in a block
    cases = [
        case("awkward 20x10 (200 elements: a short last block)", awkward),
        case("normal 37x24", torch.randn(37, 24, generator=g) * 0.3),
        # Values exactly halfway between code values, and the extremes.
        case("midpoints 1x64", torch.tensor([[
            (a + b) / 2 for a, b in zip(
                [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023],
                [-0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0])
        ] * 4 + [1.0, -1.0, 0.5, -0.5]], dtype=torch.float32)),
    ]
    with open(path, "w") as f:
        json.dump({"bitsandbytes": __import__("bitsandbytes").__version__, "cases": cases}, f)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/nf4/bnb.json")
