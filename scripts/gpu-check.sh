#!/usr/bin/env bash
# GPU check of the NCCL engine, for a machine with one NVIDIA GPU and no network.
#
# Builds nothing: it runs a prebuilt `nccl_check` (build it anywhere, no CUDA needed:
#   cargo build --release --example nccl_check --features nccl
# and copy target/release/examples/nccl_check next to this script or pass its path).
# It runs a 1-rank NCCL all_gather / reduce_scatter / all_reduce on device buffers, compares
# each with the result computed on the host, runs the engine's ProcessGroup path (uneven
# pieces, ncclCommSplit groups), and reports bandwidth against a device-to-device copy of the
# same bytes.
#
# If a `train_llama` built with the CUDA backend sits next to it (scripts/train_llama, or set
# TRAIN_LLAMA; build it on a machine with CUDA:
#   cargo build --release --example train_llama --features "cuda nccl"),
# it also trains the tiny Llama on the GPU under FSDP2 twice: with the nccl engine, where the
# parameter gathers and gradient reduce-scatters run on the tensors' device buffers, and with
# the threads engine, where they go through the host; the two loss curves must agree.
#
# Usage: scripts/gpu-check.sh [path/to/nccl_check] [MiB per message, default 64]
#
# A multi-GPU machine runs the same binary with more ranks:
#   one process, one thread per GPU:  nccl_check --gpus 0,1,2,3,4,5,6,7
#   one process per GPU (MPI launcher, the id travels in the environment):
#     export BURN_PARALLEL_NCCL_ID=$(nccl_check --print-id)
#     mpirun -np 8 -x BURN_PARALLEL_NCCL_ID bash -c \
#       'RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE \
#        LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK exec nccl_check'
# (across nodes, every node must reach rank 0's address in the id: NCCL_SOCKET_IFNAME).
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${1:-}"
if [[ -z "$bin" ]]; then
  for c in scripts/nccl_check target/release/examples/nccl_check target/debug/examples/nccl_check \
           "${CARGO_TARGET_DIR:-/nonexistent}/release/examples/nccl_check"; do
    if [[ -x "$c" ]]; then bin="$c"; break; fi
  done
fi
if [[ -z "$bin" || ! -x "$bin" ]]; then
  echo "gpu-check: no nccl_check binary; build it with" >&2
  echo "  cargo build --release --example nccl_check --features nccl" >&2
  exit 2
fi
mib="${2:-64}"

echo "== GPU"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
  echo "nvidia-smi not found (the check still tries: it needs libcuda.so and libnccl.so)"
fi

# cudarc loads libnccl.so; NCCL's wheel ships only libnccl.so.2. Offer a private link dir.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  for d in ${LD_LIBRARY_PATH//:/ } /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 \
           $(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + "/lib")' 2>/dev/null); do
    if [[ -e "$d/libnccl.so.2" && ! -e "$d/libnccl.so" ]]; then
      link_dir="$(mktemp -d)"
      ln -s "$d/libnccl.so.2" "$link_dir/libnccl.so"
      export LD_LIBRARY_PATH="$link_dir:$d:${LD_LIBRARY_PATH:-}"
      echo "linked $link_dir/libnccl.so -> $d/libnccl.so.2"
      break
    fi
  done
fi

echo "== nccl_check, 1 rank, ${mib} MiB"
"$bin" --gpus 0 --mib "$mib" --iters 20

train="${TRAIN_LLAMA:-scripts/train_llama}"
if [[ -x "$train" ]]; then
  echo "== train_llama on the GPU: fsdp2, nccl engine (device path) against threads (host path)"
  args=(--backend cuda --strategy fsdp2 --world-size 1 --steps 5 --json)
  "$train" "${args[@]}" --engine nccl > /tmp/gpu-check-nccl.jsonl
  "$train" "${args[@]}" --engine threads > /tmp/gpu-check-threads.jsonl
  python3 - /tmp/gpu-check-nccl.jsonl /tmp/gpu-check-threads.jsonl <<'PY'
import json, sys
device, host = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
print("device path losses:", device)
print("host path losses:  ", host)
worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(device, host))
print(f"largest relative difference {worst:.2e}")
sys.exit(0 if len(device) == len(host) and worst <= 1e-5 else 1)
PY
else
  echo "== no CUDA train_llama at $train: skipped the training check"
fi
