#!/usr/bin/env bash
# Builds the CUDA binaries offline and packs the GPU kit: everything a machine with one NVIDIA
# GPU, no network and no Rust needs to run scripts/gpu-check.sh.
#
# Burn's CUDA backend links a static LLVM 23 through cubecl-llvm, whose build dependency
# tracel-llvm-bundler downloads a prebuilt archive unless
#   ${XDG_DATA_HOME:-~/.local/share}/tracel/tracel-llvm-<its version in Cargo.lock>/
# holds an LLVM install and a `.tracel-llvm-installed` marker. The PyPI wheels
# mlc-llvm-static(-extra-targets) hold exactly that LLVM (the second adds NVPTX); this script
# installs them (pip, from the package registry) into a cache folder and lays the bundler's
# folder out of them. Kernels that use exp/log/sin/cos/tanh need libdevice.10.bc at run time:
# it comes from the nvidia-cuda-nvcc-cu12 wheel and goes into the kit.
#
# Usage:
#   scripts/cuda-build.sh            install the wheels, build, pack target/gpu-kit/
#   scripts/cuda-build.sh --tch      also build the LibTorch backend (needs LIBTORCH)
#   scripts/cuda-build.sh --check    only the parts that build nothing: arguments, tools,
#                                    Cargo.lock, the folders it would use (what CI runs)
#   scripts/cuda-build.sh --pack DIR pack the binaries already in DIR (train_llama,
#                                    nccl_check) with libdevice.10.bc into the kit
# Environment: BURN_PARALLEL_CUDA_CACHE (wheel cache, default ~/.cache/burn-parallel-cuda),
#   CARGO_TARGET_DIR, KIT_DIR (default <target>/gpu-kit), KIT_LIMIT_MIB (default 60),
#   LIBDEVICE (a libdevice.10.bc to pack instead of the wheel's),
#   CUDARC_CUDA_VERSION (the CUDA driver API the binaries target; default 12040, CUDA 12.4,
#   which runs on NVIDIA drivers 550 and newer). Without it cudarc, finding no nvcc, targets its
#   newest API (CUDA 13.x), whose bindings resolve symbols such as cuEventElapsedTime_v2 that
#   drivers before 570 lack, and cudarc panics when such a symbol is first called.
# Measured on a 2-core machine: 45+ minutes and 2.1 GB of target for the first build.
set -euo pipefail
cd "$(dirname "$0")/.."

LLVM_VERSION="23.1.1.post0"
NVCC_WHEEL="nvidia-cuda-nvcc-cu12"
EXAMPLES=(train_llama nccl_check)
cache="${BURN_PARALLEL_CUDA_CACHE:-$HOME/.cache/burn-parallel-cuda}"
target="${CARGO_TARGET_DIR:-target}"
kit="${KIT_DIR:-$target/gpu-kit}"
limit_mib="${KIT_LIMIT_MIB:-60}"
# The oldest driver API the kit supports (see the header); cudarc reads it at build time.
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-12040}"

die() { echo "cuda-build: $*" >&2; exit 2; }

mode=build
with_tch=0
pack_from=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) mode=check ;;
    --tch) with_tch=1 ;;
    --pack)
      [[ $# -ge 2 ]] || die "--pack needs the folder that holds the built binaries"
      mode=pack; pack_from="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
[[ "$limit_mib" =~ ^[0-9]+$ ]] || die "KIT_LIMIT_MIB must be a whole number of MiB, got '$limit_mib'"

# The bundler's version decides the folder name it looks for; reading it from Cargo.lock keeps
# the script right when the lock moves.
bundler_version() {
  awk '/^name = "tracel-llvm-bundler"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock
}

need() {
  command -v "$1" >/dev/null || die "'$1' is needed: $2"
}

# Everything the build and the packing need, checked before the 30-45 minute build.
tools() {
  need cargo "install Rust (rustup.rs)"
  need python3 "the LLVM and libdevice wheels install with pip"
  python3 -m pip --version >/dev/null 2>&1 \
    || die "python3 has no pip: the LLVM and libdevice wheels install with it (apt install python3-pip)"
  need xz "the kit's binaries are xz-compressed (apt install xz-utils)"
  need sha256sum "the kit lists its files' checksums (coreutils)"
}

llvm_home() {
  echo "${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-$1"
}

check() {
  local v
  v="$(bundler_version)"
  [[ -n "$v" ]] || die "Cargo.lock has no tracel-llvm-bundler: the cuda feature no longer needs LLVM, or the lock is missing"
  echo "tracel-llvm-bundler $v: LLVM folder $(llvm_home "$v")"
  echo "wheel cache: $cache"
  echo "kit: $kit (at most $limit_mib MiB)"
  echo "CUDA driver API: CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION"
  [[ "$CUDARC_CUDA_VERSION" =~ ^1[1-3]0[0-9]0$ ]] \
    || die "CUDARC_CUDA_VERSION must look like 12040 (CUDA 12.4), got '$CUDARC_CUDA_VERSION'"
}

install_llvm() {
  need python3 "the LLVM wheels install with pip"
  local v home static
  v="$(bundler_version)"
  home="$(llvm_home "$v")"
  if [[ -f "$home/.tracel-llvm-installed" ]]; then
    echo "LLVM already laid out in $home"
    return
  fi
  python3 -m pip install --quiet --target "$cache/llvm" \
    "mlc-llvm-static==$LLVM_VERSION" "mlc-llvm-static-extra-targets==$LLVM_VERSION"
  static="$cache/llvm/mlc_llvm_static/static"
  [[ -x "$static/bin/llvm-config" ]] || die "the LLVM wheel has no $static/bin/llvm-config (its layout changed?)"
  "$static/bin/llvm-config" --targets-built | grep -q NVPTX \
    || die "the LLVM in $static lacks the NVPTX target (mlc-llvm-static-extra-targets did not install?)"
  mkdir -p "$(dirname "$home")"
  rm -rf "$home"
  ln -s "$static" "$home"
  touch "$home/.tracel-llvm-installed"
  echo "LLVM $("$static/bin/llvm-config" --version) laid out in $home"
}

libdevice() {
  local f="${LIBDEVICE:-}"
  if [[ -n "$f" ]]; then
    [[ -f "$f" ]] || die "LIBDEVICE=$f is not a file"
    echo "$f"
    return
  fi
  need python3 "the libdevice wheel installs with pip"
  f="$(find "$cache/nvcc" -name libdevice.10.bc 2>/dev/null | head -1)"
  if [[ -z "$f" ]]; then
    python3 -m pip install --quiet --no-deps --target "$cache/nvcc" "$NVCC_WHEEL" >&2
    f="$(find "$cache/nvcc" -name libdevice.10.bc | head -1)"
  fi
  [[ -n "$f" ]] || die "the $NVCC_WHEEL wheel holds no libdevice.10.bc"
  echo "$f"
}

build() {
  need cargo "install Rust (rustup.rs)"
  local features="cuda nccl fusion"
  if [[ "$with_tch" == 1 ]]; then
    [[ -n "${LIBTORCH:-}" ]] || die "--tch needs LIBTORCH pointing at a libtorch install"
    features="$features tch"
  fi
  local args=(build --release --locked --features "$features")
  for e in "${EXAMPLES[@]}"; do args+=(--example "$e"); done
  echo "cargo ${args[*]}"
  cargo "${args[@]}"
}

# The kit: stripped, xz-compressed binaries, libdevice, the check script, and a manifest.
pack() {
  need xz "the kit's binaries are xz-compressed (apt install xz-utils)"
  need sha256sum "the kit lists its files' checksums (coreutils)"
  local from="$1" total
  rm -rf "$kit"
  mkdir -p "$kit/nvvm/libdevice"
  for e in "${EXAMPLES[@]}"; do
    [[ -f "$from/$e" ]] || die "no $from/$e: build it first (scripts/cuda-build.sh)"
    # Debug symbols are two thirds of the binary; without binutils the kit keeps them.
    strip -o "$kit/$e" "$from/$e" 2>/dev/null || cp "$from/$e" "$kit/$e"
    xz -T0 -6 -f "$kit/$e"
  done
  cp "$(libdevice)" "$kit/nvvm/libdevice/libdevice.10.bc"
  cp scripts/gpu-check.sh "$kit/gpu-check.sh"
  (cd "$kit" && sha256sum ./*.xz nvvm/libdevice/libdevice.10.bc gpu-check.sh > SHA256SUMS)
  total=$(du -sb "$kit" | cut -f1)
  echo "kit: $kit, $((total / 1024 / 1024)) MiB ($total bytes)"
  ls -l "$kit"
  if (( total > limit_mib * 1024 * 1024 )); then
    die "the kit is $total bytes, over the $limit_mib MiB limit"
  fi
}

case "$mode" in
  check) check ;;
  pack) check >/dev/null; pack "$pack_from" ;;
  build)
    check
    tools
    install_llvm
    build
    pack "$target/release/examples"
    ;;
esac
