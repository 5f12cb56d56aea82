#!/usr/bin/env python3
"""Our training step against PyTorch's, strategy by strategy, on the same Llama.

Both sides train the same Llama shape (--model): `tiny` is the built-in tiny Llama
(`LlamaConfig::tiny()`: vocab 256, hidden 64, intermediate 172, 4 layers, 4 heads over 2 kv
heads, head_dim 16, untied), where per-op overhead dominates; `hf-3m` is
examples/models/llama_hf3m.json (vocab 1024, hidden 256, intermediate 688, 4 layers, 8 heads
over 4 kv heads: 3.4M parameters, matmuls dominate), the default; `95m` is
examples/models/llama_95m.json. Each side initializes from its own seed with the config's
initializer_range. Float32, AdamW (lr 3e-3, betas 0.9/0.999, eps 1e-8, no weight decay), the
global gradient norm clipped to 1.0, on the same global batch and sequence length, --threads
compute threads per rank (default 1). Ours is the `train_llama` example (ranks are threads
of one process); PyTorch's is Hugging Face's `LlamaForCausalLM` (eager attention) under
torch.distributed on gloo, one process per rank.
Each rank trains global_batch / dp rows; the loss is the model's own causal LM loss (the mean
over every position of the batch). The tokens differ, not the work: ours come from the
binary's synthetic corpus (its loss falls), PyTorch's are uniform random (its loss stays near
ln vocab); the per-run log on stderr shows both.

GFLOP/s: the step's model FLOPs over its time, 6 x (the Linear and lm_head parameters) x
tokens plus causal attention's 6 x layers x seq x heads x head_dim x tokens, over the global
batch (the work of all ranks together) divided by the ranks.

Figures: the median step time of rank 0 over steps 2.. (the first two warm up), per run; each
strategy runs --rounds times, ours and PyTorch's alternating; the table gives the median of the
rounds and the range of the per-round ratios ours / PyTorch (below 1: ours is faster).
Not part of CI. Keep the machine otherwise idle.

On a GPU: `--backend cuda` runs ours on Burn's CUDA backend and PyTorch on `cuda:0`, strategy
`single` only (PyTorch's NCCL refuses two ranks on one GPU; ours can share it, see
gpu-check.sh). Each PyTorch step ends with `torch.cuda.synchronize()` before its time is read,
as ours reads a loss value; bf16 is autocast to bf16 on cuda.

Setup (once; torch from PyPI, the CPU wheel index is not needed):
    python3 -m venv VENV && VENV/bin/pip install torch transformers
    cargo build --release --example train_llama
Usage:
    VENV/bin/python scripts/bench-torch.py [--model tiny|hf-3m|95m]
        [--strategies single,ddp,fsdp2,fsdp2x4,tp,fsdp2_tp] [--steps 12] [--rounds 3]
        [--global-batch 8] [--seq-len 128] [--backend flex|cuda] [--threads 1] [--dtype f32|bf16]
The binary is $TRAIN_LLAMA, else target/release/examples/train_llama.

Strategies: single (1 rank); ddp (2); fsdp2 (2); fsdp2x4 (fsdp2 on 4); tp (2, tp the whole
world); fsdp2_tp (4: dp 2 x tp 2). PyTorch's tp plan is ours: q/k/v/gate/up colwise, o/down
rowwise, a vocab-parallel embedding and a colwise lm_head whose vocab-sharded logits go to
the loss under `loss_parallel`.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

# The tiny Llama (crates/models/src/config.rs, LlamaConfig::tiny).
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
)
# The other shapes, as Hugging Face config.json files both sides read.
MODEL_FILES = {"hf-3m": "examples/models/llama_hf3m.json", "95m": "examples/models/llama_95m.json"}
CONFIG_KEYS = tuple(TINY)
LR, BETAS, EPS, GRAD_CLIP = 3e-3, (0.9, 0.999), 1e-8, 1.0
WARMUP_STEPS = 2  # left out of the medians


@dataclass(frozen=True)
class Strategy:
    name: str
    ours: tuple  # train_llama's arguments
    kind: str  # how the PyTorch side parallelizes: single | ddp | fsdp2 | tp | fsdp2_tp
    world: int
    tp: int = 1

    @property
    def dp(self):
        return self.world // self.tp


STRATEGIES = {
    s.name: s
    for s in [
        Strategy("single", ("--strategy", "single", "--world-size", "1"), "single", 1),
        Strategy("ddp", ("--strategy", "ddp", "--world-size", "2"), "ddp", 2),
        Strategy("fsdp2", ("--strategy", "fsdp2", "--world-size", "2"), "fsdp2", 2),
        Strategy("fsdp2x4", ("--strategy", "fsdp2", "--world-size", "4"), "fsdp2", 4),
        Strategy("tp", ("--strategy", "tp", "--world-size", "2"), "tp", 2, tp=2),
        Strategy(
            "fsdp2_tp",
            ("--strategy", "fsdp2_tp", "--world-size", "4", "--tp", "2"),
            "fsdp2_tp",
            4,
            tp=2,
        ),
    ]
}


# ---------------------------------------------------------------------------------------------
# Ours: the train_llama binary, one JSON object per step on stdout.


def run_ours(binary, strategy, args):
    cmd = [
        binary, "--json", *strategy.ours,
        "--steps", str(args.steps),
        "--global-batch", str(args.global_batch),
        "--seq-len", str(args.seq_len),
        "--optimizer", "adamw",
        "--lr", str(LR),
        "--grad-clip", str(GRAD_CLIP),
        "--backend", args.backend,
        "--threads-per-rank", str(args.threads),
        *(("--param-dtype", "bf16", "--reduce-dtype", "f32") if args.dtype == "bf16" else ()),
        *(("--config", MODEL_FILES[args.model]) if args.model in MODEL_FILES else ()),
    ]  # fmt: skip
    env = dict(os.environ)
    if args.backend == "tch":
        # LibTorch's own thread pools (OpenMP, MKL) take every core unless told otherwise.
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr}")
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [s["step_time_s"] for s in steps], [s["loss"] for s in steps]


# ---------------------------------------------------------------------------------------------
# PyTorch: one process per rank, rank 0 writes its step times to a file.


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(strategy, args):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        port = free_port()
        mp.spawn(torch_rank, args=(strategy, vars(args), port, out), nprocs=strategy.world)
        with open(out) as f:
            result = json.load(f)
    return result["step_time_s"], result["loss"]


def torch_rank(rank, strategy, args, port, out):
    """One PyTorch rank: build, parallelize, train, and on rank 0 write the step times."""
    import torch
    import torch.distributed as dist

    # --threads per rank, as ours; one interop thread, so that no rank borrows cores.
    torch.set_num_threads(args["threads"])
    torch.set_num_interop_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if strategy.world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=strategy.world)
    try:
        torch.manual_seed(0)  # the same init on every rank, before sharding
        device = torch_device(args["backend"])
        model = build_model(args["model_config"]).to(device)
        model, loss_context = parallelize(model, strategy, rank, args["dtype"], device.type)
        opt = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0
        )
        times, losses = train(model, opt, loss_context, strategy, rank, args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"step_time_s": times, "loss": losses}, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def torch_device(backend):
    """PyTorch's device for our --backend: cuda:0 for cuda, else the CPU."""
    import torch

    return torch.device("cuda:0" if backend == "cuda" else "cpu")


def model_config(model):
    """The Llama's shape: TINY, or the keys of its config.json that TINY names."""
    if model not in MODEL_FILES:
        return dict(TINY)
    with open(MODEL_FILES[model]) as f:
        file = json.load(f)
    cfg = {k: file[k] for k in CONFIG_KEYS if k in file}
    cfg.setdefault("head_dim", file["hidden_size"] // file["num_attention_heads"])
    return cfg


def step_flops(cfg, tokens, seq):
    """Model FLOPs of one training step over `tokens` tokens (see the module doc)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    linear = layers * (h * q + 2 * h * kv + q * h + 3 * h * i) + h * cfg["vocab_size"]
    return 6 * linear * tokens + 6 * layers * seq * q * tokens


def build_model(config):
    from transformers import LlamaConfig, LlamaForCausalLM

    # No kv cache: it is for generation and would cost a copy of k and v per layer.
    cfg = LlamaConfig(**config, use_cache=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg).float().train()


def parallelize(model, strategy, rank, dtype="f32", device_type="cpu"):
    """Applies the strategy; returns the model and the context the loss runs in. With bf16,
    FSDP2 gets MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32), as our --param-dtype
    bf16 --reduce-dtype f32; the other strategies run under CPU autocast to bf16 (f32 master
    weights, bf16 matmuls)."""
    import contextlib
    import functools

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    no_context = contextlib.nullcontext
    if dtype == "bf16":
        no_context = functools.partial(torch.autocast, device_type, dtype=torch.bfloat16)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard = functools.partial(fully_shard, mp_policy=policy)
    kind = strategy.kind
    if kind == "single":
        return model, no_context
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), no_context
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (strategy.world,))
        # The policy casts: no autocast on top.
        context = contextlib.nullcontext
        return shard(model, mesh, fully_shard), context
    # tp, fsdp2_tp: tp is the inner dim (consecutive ranks), as ours.
    mesh = init_device_mesh("cpu", (strategy.dp, strategy.tp), mesh_dim_names=("dp", "tp"))
    loss_context = apply_tp(model, mesh["tp"])
    if kind == "fsdp2_tp":
        model = shard(model, mesh["dp"], fully_shard)
        return model, loss_context
    if dtype == "bf16":
        parallel = loss_context

        @contextlib.contextmanager
        def loss_context():
            with parallel(), no_context():
                yield

    return model, loss_context


def shard(model, mesh, fully_shard):
    # Each decoder layer its own unit (one all-gather / reduce-scatter each), then the rest.
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def apply_tp(model, tp_mesh):
    """Our `llama` plan (crates/models/src/plan.rs); returns the loss context (loss_parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    # The heads split over tp: the attention's views use -1 heads, so no attribute changes.
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    parallelize_module(
        model,
        tp_mesh,
        {
            # Vocab-parallel embedding: replicated ids, all-reduced output.
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            # Logits stay sharded on the vocab, the loss reduces over the shards.
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    return loss_parallel


def train(model, opt, loss_context, strategy, rank, args):
    import torch

    dp_rank = rank // strategy.tp  # the ranks of a tp group train the same rows
    rows = args["global_batch"] // strategy.dp
    seq = args["seq_len"]
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    device = torch_device(args["backend"])
    times, losses = [], []
    for _ in range(args["steps"]):
        start = time.perf_counter()
        vocab = args["model_config"]["vocab_size"]
        tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        # Contiguous: the loss flattens the targets with a view.
        tokens = tokens.to(device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with loss_context():
            # shift_labels: the targets are already shifted, every position counts (as ours).
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
            loss.backward()
        clip_grad_norm(model, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are queued, not done
        times.append(time.perf_counter() - start)
        losses.append(local_value(loss))
    return times, losses


def clip_grad_norm(model, max_norm):
    """`clip_grad_norm_`, grouped by mesh: under tp the parameters mix plain tensors (norms)
    with DTensors on different meshes, whose norms torch cannot stack together."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    groups = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    if len(groups) == 1:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces the partial norms over the mesh
        squares.append(norm**2)
    total = torch.stack(squares).sum().sqrt()
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)


def local_value(loss):
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# Rounds and the table.


def median_step(times):
    timed = times[WARMUP_STEPS:]
    if not timed:
        raise RuntimeError(f"only {len(times)} step(s): need more than {WARMUP_STEPS}")
    return statistics.median(timed)


def bench(strategy, binary, args):
    """Runs the strategy --rounds times, ours then PyTorch's; returns a table row."""
    ours, theirs, ratios, error = [], [], [], None
    for r in range(1, args.rounds + 1):
        print(f"== round {r}: {strategy.name}", file=sys.stderr, flush=True)
        t, loss = run_ours(binary, strategy, args)
        ours.append(median_step(t))
        log_run("ours", t, loss)
        if error is None:  # a strategy that failed once would fail again
            try:
                t, loss = run_torch(strategy, args)
                theirs.append(median_step(t))
                ratios.append(ours[-1] / theirs[-1])
                log_run("torch", t, loss)
            except Exception as e:  # printed, and the other strategies go on
                error = first_line(e)
                print(f"PyTorch {strategy.name} failed:", file=sys.stderr)
                traceback.print_exc()
    return strategy.name, ours, theirs, ratios, error


def log_run(side, times, loss):
    print(
        f"   {side:5}: median step {median_step(times):.4f} s, loss {loss[0]:.3f} -> {loss[-1]:.3f}",
        file=sys.stderr,
        flush=True,
    )


def first_line(e):
    # A child's exception arrives as "process N terminated with ...\n\n<its traceback>": the
    # last non-empty line of the traceback says what failed.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def print_table(rows, args):
    flops = step_flops(args.model_config, args.global_batch * args.seq_len, args.seq_len)
    print(
        f"\n{args.model} Llama ({flops / 1e9:.1f} GFLOP per step), global batch "
        f"{args.global_batch} x seq {args.seq_len}, AdamW, "
        f"grad clip {GRAD_CLIP}, {args.dtype}, {args.threads} thread(s) per rank, {args.backend} backend; median step "
        f"time of rank 0 over steps {WARMUP_STEPS}..{args.steps - 1}, median of {args.rounds} "
        f"round(s)"
    )
    print(
        f"{'strategy':10} {'ours s':>9} {'PyTorch s':>10} {'ours/PyTorch':>13} {'range':>13} "
        f"{'GFLOP/s/rank ours':>18} {'PyTorch':>8}"
    )
    for name, ours, theirs, ratios, error in rows:
        ours_s = statistics.median(ours)
        world = STRATEGIES[name].world
        rate = lambda s: flops / world / s / 1e9  # noqa: E731
        if error is not None and not theirs:
            print(f"{name:10} {ours_s:9.4f} {'failed':>10}   {error}")
            continue
        theirs_s = statistics.median(theirs)
        span = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(
            f"{name:10} {ours_s:9.4f} {theirs_s:10.4f} {ours_s / theirs_s:13.2f} {span:>13} "
            f"{rate(ours_s):18.1f} {rate(theirs_s):8.1f}"
        )
        if error is not None:
            print(f"{'':10} PyTorch failed in a later round: {error}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="hf-3m", choices=["tiny", *MODEL_FILES])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--backend", default="flex", choices=["flex", "ndarray", "wgpu", "cuda", "tch"],
                   help="ours; PyTorch runs on cuda:0 with cuda, else on the CPU")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank, both sides")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                   help="bf16: ours --param-dtype bf16 --reduce-dtype f32; PyTorch FSDP2's "
                        "MixedPrecisionPolicy alike, CPU autocast to bf16 elsewhere")
    args = p.parse_args()
    names = [n for n in args.strategies.split(",") if n]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        p.error(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    if args.backend == "cuda" and names != ["single"]:
        p.error("--backend cuda compares the single strategy only (--strategies single): "
                "PyTorch's NCCL cannot put two ranks on one GPU")
    for n in names:
        if args.global_batch % STRATEGIES[n].dp:
            p.error(f"--global-batch {args.global_batch} does not split over {n}'s dp ranks")
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must be over {WARMUP_STEPS} (the first {WARMUP_STEPS} are left out)")
    args.strategies = names
    args.model_config = model_config(args.model)
    return args


def main():
    args = parse_args()
    binary = os.environ.get("TRAIN_LLAMA", "target/release/examples/train_llama")
    if not os.access(binary, os.X_OK):
        sys.exit(
            f"bench-torch: no train_llama binary at {binary}: build it with "
            "`cargo build --release --example train_llama`, or set TRAIN_LLAMA"
        )
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        sys.exit(
            f"bench-torch: {e}: run with a Python that has torch and transformers "
            "(python3 -m venv VENV && VENV/bin/pip install torch transformers)"
        )
    started = time.perf_counter()
    rows = [bench(STRATEGIES[n], binary, args) for n in args.strategies]
    print_table(rows, args)
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
