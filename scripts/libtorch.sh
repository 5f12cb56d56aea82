#!/usr/bin/env bash
# LibTorch for `--features tch` and `--backend tch`, from PyPI's torch wheel: the version tch
# 0.22 (burn-tch 0.22) expects, 2.9.0, installed into a virtual environment in a cache folder.
# tch's build script then reads it through that Python (LIBTORCH_USE_PYTORCH=1), and the
# binaries load it from the wheel's torch/lib at run time.
#
# PyPI's Linux wheel is the CUDA build: libtorch.so links libtorch_cuda.so, which needs the
# nvidia-* wheels it depends on even where LibTorch runs on the CPU (6-7 GB installed,
# about 2 minutes from PyPI). On a machine without a GPU, `--backend tch` runs on the CPU.
#
# Usage:
#   scripts/libtorch.sh install        install torch (once; a second call checks and returns)
#   scripts/libtorch.sh check          whether the cache holds it (exit 0) or not (exit 1)
#   scripts/libtorch.sh env            the exports that build and run with it:
#                                        eval "$(scripts/libtorch.sh env)"
#   scripts/libtorch.sh build ARGS     cargo build ARGS with those exports and a patched
#                                      burn-dispatch (below), e.g.
#     CARGO_TARGET_DIR=target-tch scripts/libtorch.sh build --release --features tch --example train_llama
#   scripts/libtorch.sh run CMD ARGS   CMD with those exports, after checking the install, e.g.
#     scripts/libtorch.sh run target-tch/release/examples/train_llama --backend tch
#
# burn-dispatch 0.22.1's `grad_replace` has no arm for LibTorch tensors: every gradient
# replacement (DDP's all-reduce, clipping, accumulation) panics there with "The provided tensors
# are not on the same backend". `build` copies the registry's burn-dispatch 0.22.1 into the
# cache, adds that arm (as the other backends have it), and builds with it as a
# `patch.crates-io` given on the command line, so the repository's builds and Cargo.lock keep
# the registry's crate (Cargo.lock is restored after the build). Drop this once Burn ships the
# arm.
# Environment: BURN_PARALLEL_LIBTORCH (the virtual environment, default
#   ~/.cache/burn-parallel-libtorch/torch-<version>), PYTHON (default python3, 3.10-3.13).
set -euo pipefail

TORCH_VERSION=2.9.0
venv="${BURN_PARALLEL_LIBTORCH:-$HOME/.cache/burn-parallel-libtorch/torch-$TORCH_VERSION}"
python="${PYTHON:-python3}"

cache="$(dirname "$venv")"
DISPATCH=burn-dispatch-0.22.1

die() {
  echo "libtorch: $*" >&2
  exit 2
}

# The torch package folder of the install (its include/ and lib/), or nothing.
torch_dir() {
  [[ -x "$venv/bin/python" ]] || return 0
  "$venv/bin/python" - "$TORCH_VERSION" <<'PY' 2>/dev/null || true
import sys, pathlib
import torch
if torch.__version__.split("+")[0] == sys.argv[1]:
    print(pathlib.Path(torch.__file__).parent)
PY
}

check() {
  local dir
  dir="$(torch_dir)"
  if [[ -n "$dir" && -f "$dir/lib/libtorch_cpu.so" ]]; then
    echo "libtorch: torch $TORCH_VERSION in $dir"
    return 0
  fi
  echo "libtorch: no torch $TORCH_VERSION in $venv: run scripts/libtorch.sh install" >&2
  return 1
}

install() {
  if check 2>/dev/null; then
    return 0
  fi
  command -v "$python" >/dev/null || die "'$python' is needed to install the torch wheel (set PYTHON)"
  "$python" -m venv "$venv" || die "'$python -m venv' failed (Debian: apt install python3-venv)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" ||
    die "pip could not install torch==$TORCH_VERSION into $venv"
  check
}

env_lines() {
  local dir
  dir="$(torch_dir)"
  [[ -n "$dir" ]] || die "no torch $TORCH_VERSION in $venv: run scripts/libtorch.sh install"
  # The build runs `python3` to find LibTorch; the binaries find it on LD_LIBRARY_PATH.
  printf 'export LIBTORCH_USE_PYTORCH=1\n'
  printf 'export PATH=%q:"$PATH"\n' "$venv/bin"
  printf 'export LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' "$dir/lib"
}

# The registry's burn-dispatch with LibTorch's arm in `grad_replace`; prints its folder.
patched_dispatch() {
  local dst="$cache/$DISPATCH-libtorch" src
  if [[ -f "$dst/.patched" ]]; then
    echo "$dst"
    return
  fi
  src="$(cargo metadata --format-version 1 --locked 2>/dev/null | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "burn-dispatch" and p["version"] == "0.22.1":
        print(p["manifest_path"].rsplit("/", 1)[0])')" || true
  [[ -n "$src" && -d "$src" ]] || die "no $DISPATCH source in cargo's registry (run cargo fetch first)"
  rm -rf "$dst"
  cp -r "$src" "$dst"
  python3 - "$dst/src/backend.rs" <<'PY' || die "could not patch $dst/src/backend.rs"
import sys
path = sys.argv[1]
text = open(path).read()
anchor = """                (DispatchTensorKind::Autodiff(_), _) => {
                    panic!("Autodiff should not wrap an autodiff tensor.")"""
arm = """                #[cfg(feature = "tch")]
                (DispatchTensorKind::LibTorch(tensor), DispatchTensorKind::LibTorch(grad)) => {
                    tensor.as_autodiff().grad_replace(grads, grad.float())
                }
"""
start = text.index("fn grad_replace(")
at = text.index(anchor, start)
if "DispatchTensorKind::LibTorch(grad)" in text[start:at]:
    sys.exit("already has the arm")
open(path, "w").write(text[:at] + arm + text[at:])
PY
  touch "$dst/.patched"
  echo "$dst"
}

lock_backup=""

build() {
  check >/dev/null || exit 1
  local dispatch
  dispatch="$(patched_dispatch)"
  lock_backup="$(mktemp)"
  cp Cargo.lock "$lock_backup"
  # The patch rewrites Cargo.lock's burn-dispatch entry: put the repository's back afterwards.
  trap 'cp "$lock_backup" Cargo.lock; rm -f "$lock_backup"' EXIT
  eval "$(env_lines)"
  cargo --config "patch.crates-io.burn-dispatch.path=\"$dispatch\"" build "$@"
}

case "${1:-}" in
  install) install ;;
  check) check ;;
  env) env_lines ;;
  build)
    shift
    cd "$(dirname "$0")/.."
    build "$@"
    ;;
  run)
    shift
    [[ $# -gt 0 ]] || die "run needs a command"
    check >/dev/null || exit 1
    eval "$(env_lines)"
    exec "$@"
    ;;
  -h | --help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) die "unknown command '$1' (see --help)" ;;
esac
