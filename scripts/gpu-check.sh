#!/usr/bin/env bash
# GPU check of burn-parallel on a machine with one NVIDIA GPU, no network and no Rust.
#
# The GPU kit. scripts/cuda-build.sh, run where there is Rust and a network (the first build
# takes 45+ minutes on 2 cores), builds train_llama and nccl_check with
# --features "cuda nccl fusion" and packs them into target/gpu-kit/:
#   train_llama.xz, nccl_check.xz    stripped and xz-compressed (train_llama also has the CPU
#                                    backends: its --backend flex run is the reference here)
#   nvvm/libdevice/libdevice.10.bc   CUDA's math library. The CUDA backend links it into
#                                    kernels that call exp/log/tanh/...
#   gpu-check.sh                     this script
#   SHA256SUMS                       verified first (sha256sum -c)
# Copy the folder to the GPU machine and run ./gpu-check.sh inside it. It decompresses the
# binaries once into a work folder, with xz or else python3's lzma module. It needs bash 4.4+,
# coreutils (timeout, sha256sum), awk and the NVIDIA driver (libcuda.so.1; nvidia-smi for the
# memory figures). For the NCCL part it needs libnccl (Debian's libnccl2, or the
# nvidia-nccl-cu12 wheel, whose python package nvidia.nccl it searches). It sets CUDA_PATH to
# the kit, so that the backend finds $CUDA_PATH/nvvm/libdevice/libdevice.10.bc, unless your
# CUDA_PATH already holds that file. It ends in under 5 minutes: every run is under `timeout`,
# and a total time budget applies.
#
# The checks use the built-in tiny Llama for 5 steps, with a global batch of 8 x 64 tokens and
# AdamW. Each check prints a PASS/FAIL/SKIPPED line, and a summary follows at the end. Exit
# status: 0 when nothing failed, 1 when a check failed (a check that the time budget left no
# time for counts as failed), 2 when the machine cannot run the checks (no driver, no
# libdevice, no binary, a damaged kit).
#   1. Single device: the --backend cuda loss of each step against the --backend flex run
#      (CPU, f32), twice: with SGD within 1e-5 (the same math), and with AdamW within 1e-3.
#      Burn's CUDA f32 matmuls may run on TF32 tensor cores (the autotuner may pick a
#      tensor-core kernel, for which cubek-matmul rounds f32 operands to tf32), which moves
#      the gradients by about 2e-5 relative (measured on an H200). SGD passes that on as it
#      is; AdamW divides each element's step by its own gradient's size, so elements whose
#      gradient is near zero step differently, and the curves part by up to about 5e-4 over 5
#      steps (on one CPU every strategy agrees with one device to 1e-6). --param-dtype bf16
#      is compared with the flex f32 AdamW run, within 1e-2.
#   2. fsdp2 and tp on 2 rank threads that share the GPU (threads engine, with exchanges
#      through the host; LOCAL_RANK=0 puts both ranks on GPU 0), against the single-device
#      flex curves: SGD within 1e-5, AdamW within 1e-3.
#   3. With libnccl: nccl_check --gpus 0 runs all_gather / reduce_scatter / all_reduce on
#      device buffers, compares them with the host result and measures their bandwidth
#      against a device-to-device copy. Then fsdp2 on 1 rank with the nccl engine (exchanges
#      on device buffers) runs against the threads engine, within 5e-5. Without libnccl this
#      part is SKIPPED: the script names every folder it searched, and the check does not fail.
#   4. Compile (Burn's kernel fusion, `enable_compile: true`; the kit is built with the
#      `fusion` feature): single, and fsdp2 on 1 rank with the nccl engine when libnccl is
#      there (the NCCL step as a fusion boundary), against the same runs eager (the runs above):
#      single with SGD within 1e-5, fsdp2 with AdamW within 1e-3. Skipped with --cpu (flex has
#      no kernel fusion).
#   5. Report: the per-step JSON of the single-device cuda run, and for every run its wall
#      time, tokens/s and peak GPU memory. Tokens/s is taken over the steps after the first,
#      from the JSON's step_time_s and tokens_per_s. Peak memory comes from nvidia-smi, polled
#      every 0.2 s, with the memory in use before the run alongside.
#
# Usage: ./gpu-check.sh [path/to/nccl_check] [MiB per nccl_check message, default 64]
#        ./gpu-check.sh --cpu   every run on --backend flex, without the driver, libdevice
#                               and NCCL parts: a test of this script on any machine
# From the repository, scripts/gpu-check.sh takes the binaries from target/release/examples
# (or $CARGO_TARGET_DIR/release/examples), and libdevice from target/gpu-kit or the wheel
# cache of scripts/cuda-build.sh.
# Environment: TRAIN_LLAMA and NCCL_CHECK name binaries (plain or .xz) to use instead of the
#   kit's. CUDA_PATH is kept when it holds nvvm/libdevice/libdevice.10.bc. GPU_CHECK_STEPS
#   (default 5), GPU_CHECK_TIMEOUT (default 120 s per run), GPU_CHECK_BUDGET (default 280 s in
#   all). GPU_CHECK_WORK names a folder to decompress into; it is kept and reused by the next
#   run. Without it, the work folder is temporary and is removed at the end; its logs (stdout
#   and stderr of every run, the memory samples) are kept when something failed, or always with
#   GPU_CHECK_KEEP=1.
#
# The NCCL runs get BURN_PARALLEL_TIMEOUT_SECS=60 (a stuck call ends with an error naming it,
# well inside the run's timeout) and NCCL_DEBUG=WARN (NCCL's own reason on stderr).
#
# A multi-GPU machine runs the same binaries with more ranks:
#   one process, one thread per GPU:  nccl_check --gpus 0,1,2,3,4,5,6,7
#                                     train_llama --backend cuda --engine nccl --world-size 8
#   one process per GPU: rank 0's process must create NCCL's id (its bootstrap root listens
#   there), so every process gets rank 0's address instead of an id, and rank 0 starts the root:
#     mpirun -np 8 -x NCCL_COMM_ID=$(hostname -i):29500 bash -c \
#       'RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE \
#        LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK exec nccl_check'
#   (a binary built with the mpi feature needs none of that under mpirun: rank 0 creates the
#   id and broadcasts it over MPI). Across nodes, every node must reach rank 0's address
#   (NCCL_SOCKET_IFNAME picks the interface).
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@" # started as `sh gpu-check.sh`
set -euo pipefail
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
  echo "gpu-check: needs bash 4.4 or newer, this is $BASH_VERSION" >&2
  exit 2
fi

STEPS="${GPU_CHECK_STEPS:-5}"
RUN_TIMEOUT="${GPU_CHECK_TIMEOUT:-120}"
BUDGET="${GPU_CHECK_BUDGET:-280}"
BATCH=8
SEQ_LEN=64
# SGD against the CPU: the same math, TF32 matmuls included (see the header).
TOL_SGD=1e-5
# AdamW against the CPU: TF32's gradients, with each element's step normalized.
TOL_ADAMW=1e-3
TOL_BF16=1e-2
# nccl against threads engine, same device and strategy: only the exchange path differs
# (about a relative 1e-5 at the tiny model's loss of ~5).
TOL_ENGINE=5e-5
LIBDEVICE_REL=nvvm/libdevice/libdevice.10.bc
# The NCCL runs' environment: a stuck call fails within a minute naming itself (inside the
# run's timeout), and NCCL says why on stderr.
NCCL_ENV=(BURN_PARALLEL_TIMEOUT_SECS=60 NCCL_DEBUG=WARN)

kit=""            # this script's folder: the kit, or scripts/ in the repository
repo=""           # the repository root when run as scripts/gpu-check.sh
work=""           # where binaries are decompressed and logs written
work_is_temp=0
cpu_only=0        # --cpu: flex everywhere, no driver needed
dev=cuda          # the backend of the "GPU" runs
have_smi=0
nccl_ok=0
nccl_looked=""    # where setup_nccl searched, for the SKIPPED line
train=""
nccl_check=""
mib=64
start_s=$SECONDS
mem_pid=""
passed=0
failed=0
skipped=0
results=()
runs=()
declare -gA run_rc=() run_wall=() run_mem=()

say() { printf '%s\n' "$*"; }
die() {
  printf 'gpu-check: %s\n' "$*" >&2
  exit 2
}

# result STATUS LABEL [DETAIL]: one PASS/FAIL/SKIPPED line, kept for the summary.
result() {
  local line
  line="$(printf '%-8s %s' "$1" "$2${3:+: $3}")"
  results+=("$line")
  say "$line"
  case "$1" in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    *) skipped=$((skipped + 1)) ;;
  esac
}

usage() {
  sed -n '2,/^[^#]/{ /^#/ s/^# \{0,1\}//p; }' "${BASH_SOURCE[0]}"
}

cleanup() {
  local rc=$?
  if [[ -n "$mem_pid" ]]; then
    kill "$mem_pid" 2>/dev/null || true
  fi
  if [[ "$work_is_temp" == 1 && -d "$work" ]]; then
    if [[ "$rc" == 0 && "${GPU_CHECK_KEEP:-0}" != 1 ]]; then
      rm -rf "$work"
    else
      rm -f "$work/train_llama" "$work/nccl_check"
      if compgen -G "$work/*.err" >/dev/null; then
        say "logs kept in $work"
      else
        rm -rf "$work"
      fi
    fi
  fi
}

# The loader's cache, wherever ldconfig is (/sbin is not on every PATH).
ldconfig_cache() {
  local ldc
  ldc="$(command -v ldconfig 2>/dev/null || true)"
  [[ -z "$ldc" && -x /sbin/ldconfig ]] && ldc=/sbin/ldconfig
  [[ -n "$ldc" ]] || return 0
  "$ldc" -p 2>/dev/null || true
}

ld_library_dirs() {
  local dirs=() d
  IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
  for d in "${dirs[@]}"; do
    [[ -n "$d" ]] && printf '%s\n' "$d"
  done
  return 0
}

verify_sums() {
  if [[ ! -f "$kit/SHA256SUMS" ]]; then
    say "no SHA256SUMS in $kit: the files are not verified"
    return
  fi
  local out
  if command -v sha256sum >/dev/null 2>&1; then
    if out="$(cd "$kit" && sha256sum -c SHA256SUMS 2>&1)"; then
      say "SHA256SUMS: $(grep -c ': OK$' <<<"$out") files verified"
      return
    fi
  elif command -v shasum >/dev/null 2>&1; then
    if out="$(cd "$kit" && shasum -a 256 -c SHA256SUMS 2>&1)"; then
      say "SHA256SUMS: $(grep -c ': OK$' <<<"$out") files verified"
      return
    fi
  else
    say "neither sha256sum nor shasum is installed: SHA256SUMS is not verified"
    return
  fi
  grep -v ': OK$' <<<"$out" >&2 || true
  die "the kit in $kit does not match its SHA256SUMS (a damaged or incomplete copy, or an edited file): copy the kit again"
}

can_decompress() {
  command -v xz >/dev/null 2>&1 || python3 -c 'import lzma' >/dev/null 2>&1
}

# unpack SRC.xz DEST: decompresses once (a DEST newer than SRC is reused).
unpack() {
  local src="$1" dst="$2"
  if [[ -x "$dst" && "$dst" -nt "$src" ]]; then
    say "reusing $dst (decompressed from $src before)"
    return
  fi
  if command -v xz >/dev/null 2>&1; then
    xz -dc -- "$src" >"$dst.part" || die "xz could not decompress $src (a damaged file?)"
  elif python3 -c 'import lzma' >/dev/null 2>&1; then
    python3 -c '
import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], "wb") as g:
    shutil.copyfileobj(f, g, 1 << 20)' "$src" "$dst.part" ||
      die "python3 could not decompress $src (a damaged file?)"
  else
    die "cannot decompress $src: there is no xz, and no python3 with the lzma module. Install" \
      "xz-utils, or decompress the .xz files elsewhere (xz -dk) and pass TRAIN_LLAMA=... NCCL_CHECK=..."
  fi
  chmod +x "$dst.part"
  mv -f "$dst.part" "$dst"
  say "decompressed $src -> $dst"
}

# resolve_bin VAR NAME GIVEN: sets VAR to a runnable NAME. GIVEN (an env var or argument) goes
# first; then the kit's NAME.xz or NAME; then the repository's build folders. Empty when none.
resolve_bin() {
  local var="$1" name="$2" given="$3" c
  local cands=()
  if [[ -n "$given" ]]; then
    [[ -f "$given" ]] || die "$name: '$given' is not a file"
    cands=("$given")
  else
    cands=("$kit/$name.xz" "$kit/$name")
    if [[ -n "$repo" ]]; then
      [[ -n "${CARGO_TARGET_DIR:-}" ]] && cands+=("$CARGO_TARGET_DIR/release/examples/$name")
      cands+=("$repo/target/release/examples/$name")
      # nccl_check builds anywhere and needs no optimization to check.
      [[ "$name" == nccl_check ]] && cands+=("$repo/target/debug/examples/$name")
    fi
  fi
  printf -v "$var" '%s' ""
  for c in "${cands[@]}"; do
    [[ -f "$c" ]] || continue
    if [[ "$c" == *.xz ]]; then
      unpack "$c" "$work/$name"
      printf -v "$var" '%s' "$work/$name"
      return
    elif [[ -x "$c" ]]; then
      printf -v "$var" '%s' "$c"
      return
    fi
  done
}

check_driver() {
  local where="" d smi
  if ldconfig_cache | grep -q 'libcuda\.so\.1 '; then
    where="the loader cache (ldconfig -p)"
  else
    while IFS= read -r d; do
      if [[ -e "$d/libcuda.so.1" ]]; then
        where="$d (LD_LIBRARY_PATH)"
        break
      fi
    done < <(ld_library_dirs)
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    if ! smi="$(timeout 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used \
      --format=csv,noheader 2>&1)"; then
      printf '%s\n' "$smi" >&2
      die "nvidia-smi failed: the NVIDIA driver is not working on this machine (not loaded," \
        "or no GPU visible to this container)"
    fi
    have_smi=1
  fi
  if [[ -z "$where" ]]; then
    die "no NVIDIA driver: libcuda.so.1 is not in the loader cache (ldconfig -p)" \
      "nor in LD_LIBRARY_PATH (${LD_LIBRARY_PATH:-unset})$([[ "$have_smi" == 0 ]] && echo ", and nvidia-smi is missing")." \
      "Install the NVIDIA driver (it brings libcuda.so.1 and nvidia-smi), or add the folder that" \
      "holds libcuda.so.1 to LD_LIBRARY_PATH"
  fi
  say "CUDA driver library: libcuda.so.1 in $where"
  if [[ "$have_smi" == 1 ]]; then
    say "GPU (index, name, driver, memory total, memory used):"
    say "$smi"
  else
    say "nvidia-smi not found: peak GPU memory reads 'unknown'"
  fi
}

# CUDA_PATH: the user's when it has libdevice, else the first folder that has it.
setup_libdevice() {
  local looked=() c cache found
  if [[ -n "${CUDA_PATH:-}" ]]; then
    if [[ -f "$CUDA_PATH/$LIBDEVICE_REL" ]]; then
      say "libdevice: $CUDA_PATH/$LIBDEVICE_REL (your CUDA_PATH)"
      return
    fi
    say "your CUDA_PATH=$CUDA_PATH has no $LIBDEVICE_REL: looking elsewhere"
    looked+=("$CUDA_PATH")
  fi
  local cands=("$kit")
  if [[ -n "$repo" ]]; then
    cands+=("${CARGO_TARGET_DIR:-$repo/target}/gpu-kit")
    # The nvidia-cuda-nvcc-cu12 wheel that scripts/cuda-build.sh installed.
    cache="${BURN_PARALLEL_CUDA_CACHE:-${HOME:-/nonexistent}/.cache/burn-parallel-cuda}/nvcc"
    found="$(find "$cache" -path "*/$LIBDEVICE_REL" -print -quit 2>/dev/null || true)"
    if [[ -n "$found" ]]; then cands+=("${found%/"$LIBDEVICE_REL"}"); else cands+=("$cache"); fi
  fi
  # The backend's own fallbacks when CUDA_PATH is unset.
  cands+=(/usr/local/cuda /opt/cuda /usr/lib/cuda /usr)
  for c in "${cands[@]}"; do
    if [[ -f "$c/$LIBDEVICE_REL" ]]; then
      export CUDA_PATH="$c"
      say "libdevice: $CUDA_PATH/$LIBDEVICE_REL (CUDA_PATH=$CUDA_PATH)"
      return
    fi
    looked+=("$c")
  done
  die "libdevice.10.bc not found: looked for $LIBDEVICE_REL in ${looked[*]}." \
    "The kit should have it (scripts/cuda-build.sh copies it from the nvidia-cuda-nvcc-cu12" \
    "wheel); or set CUDA_PATH to a CUDA toolkit that has it"
}

# libnccl.so on the loader path, or a private link to a lone libnccl.so.2 (the NCCL wheel
# ships only that; cudarc loads libnccl.so). Sets nccl_ok.
setup_nccl() {
  local dirs=() looked=() d py
  if ldconfig_cache | grep -q 'libnccl\.so '; then
    say "NCCL: libnccl.so in the loader cache"
    nccl_ok=1
    return
  fi
  while IFS= read -r d; do dirs+=("$d"); done < <(ld_library_dirs)
  dirs+=(/usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 /usr/lib64)
  # A libnccl.so.2 the loader cache knows, wherever it is.
  while IFS= read -r d; do dirs+=("$(dirname "$d")"); done < <(ldconfig_cache | awk '/libnccl\.so\.2 / { print $NF }')
  if py="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null)"; then
    dirs+=("$py")
  else
    looked+=("python3's nvidia.nccl package (not installed)")
  fi
  for d in "${dirs[@]}"; do
    looked+=("$d")
    if [[ -e "$d/libnccl.so" ]]; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      say "NCCL: $d/libnccl.so"
      nccl_ok=1
      return
    fi
    if [[ -e "$d/libnccl.so.2" ]]; then
      mkdir -p "$work/nccl-link"
      ln -sf "$d/libnccl.so.2" "$work/nccl-link/libnccl.so"
      export LD_LIBRARY_PATH="$work/nccl-link:$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      say "NCCL: linked $work/nccl-link/libnccl.so -> $d/libnccl.so.2"
      nccl_ok=1
      return
    fi
  done
  nccl_looked="the loader cache (ldconfig -p), $(printf '%s, ' "${looked[@]}")"
  nccl_looked="${nccl_looked%, }"
  say "NCCL: no libnccl.so or libnccl.so.2 in the loader cache (ldconfig -p) nor in any of:"
  for d in "${looked[@]}"; do say "  $d"; done
  say "  (install Debian's libnccl2, or pip install nvidia-nccl-cu12, or put the folder of" \
    "libnccl.so.2 on LD_LIBRARY_PATH)"
}

now() { date +%s.%N; }

# mem_start NAME / mem_stop NAME: the largest memory.used nvidia-smi reports while a run goes.
mem_start() {
  local file="$work/$1.mem"
  : >"$file"
  [[ "$have_smi" == 1 ]] || return 0
  timeout 5 nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >"$work/$1.mem0" 2>/dev/null || true
  (
    while :; do
      timeout 5 nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null || true
      sleep 0.2
    done
  ) >>"$file" &
  mem_pid=$!
}

# The largest whole number in the first column of a file (nothing when none).
max_of() {
  awk '$1 ~ /^[0-9]+$/ && (!seen || $1 + 0 > m) { m = $1 + 0; seen = 1 } END { if (seen) print m }' \
    "$1" 2>/dev/null || true
}

mem_stop() {
  local name="$1" peak base
  if [[ -n "$mem_pid" ]]; then
    kill "$mem_pid" 2>/dev/null || true
    wait "$mem_pid" 2>/dev/null || true
    mem_pid=""
  fi
  if [[ "$have_smi" != 1 ]]; then
    run_mem[$name]="unknown (no nvidia-smi)"
    return
  fi
  peak="$(max_of "$work/$name.mem")"
  base="$(max_of "$work/$name.mem0")"
  if [[ -n "$peak" ]]; then
    run_mem[$name]="$peak MiB (${base:-?} MiB before the run)"
  else
    run_mem[$name]="unknown (no sample: the run was shorter than a poll)"
  fi
}

# run NAME GPU CMD...: runs CMD under timeout with stdout to $work/NAME.out and stderr to
# $work/NAME.err; GPU=1 polls the GPU's memory. Returns CMD's status ("skip" in run_rc when
# the time budget is spent).
run() {
  local name="$1" gpu="$2"
  shift 2
  local left limit rc=0 t0 t1
  runs+=("$name")
  [[ "$cpu_only" == 1 ]] && gpu=0
  : >"$work/$name.out"
  : >"$work/$name.err"
  left=$((BUDGET - (SECONDS - start_s)))
  if ((left < 20)); then
    say "== $name: skipped, the ${BUDGET}s time budget is spent"
    run_rc[$name]=skip
    return 1
  fi
  limit=$((left - 5 < RUN_TIMEOUT ? left - 5 : RUN_TIMEOUT))
  say "== $name (timeout ${limit}s): $*"
  [[ "$gpu" == 1 ]] && mem_start "$name"
  t0="$(now)"
  # --foreground: Ctrl-C reaches the run (timeout's own process group would shield it).
  timeout --foreground -k 5 "$limit" "$@" >"$work/$name.out" 2>"$work/$name.err" || rc=$?
  t1="$(now)"
  if [[ "$gpu" == 1 ]]; then mem_stop "$name"; else run_mem[$name]="- (CPU run)"; fi
  run_wall[$name]="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  run_rc[$name]=$rc
  if [[ "$rc" != 0 ]]; then
    if [[ "$rc" == 124 || "$rc" == 137 ]]; then
      say "   timed out after ${limit}s"
    else
      say "   exit status $rc"
    fi
    say "   last lines of its stderr ($work/$name.err):"
    tail -n 15 "$work/$name.err" | sed 's/^/   | /'
  fi
  return "$rc"
}

# train_run NAME GPU ENV... -- ARGS...: train_llama with the common flags, JSON per step.
train_run() {
  local name="$1" gpu="$2" envs=()
  shift 2
  while [[ $# -gt 0 && "$1" != -- ]]; do envs+=("$1"); shift; done
  shift
  run "$name" "$gpu" env -u RANK -u WORLD_SIZE -u LOCAL_RANK "${envs[@]}" "$train" "$@" \
    --steps "$STEPS" --global-batch "$BATCH" --seq-len "$SEQ_LEN" --json || true
}

# compare_losses TOL NAME_A FILE_A NAME_B FILE_B: prints the two loss curves side by side, then a
# last line "PASS <detail>" or "FAIL <detail>".
compare_losses() {
  awk -v tol="$1" -v an="$2" -v bn="$4" -v steps="$STEPS" -v file=1 '
    function loss(s) {
      if (match(s, /"loss":[^,}]*/)) return substr(s, RSTART + 7, RLENGTH - 7)
      return "missing"
    }
    function number(v) { return v ~ /^-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$/ }
    BEGIN { t = tol + 0; worst = -1 }
    /^\{/ { if (file == 1) a[na++] = loss($0); else b[nb++] = loss($0) }
    END {
      printf "   %4s  %-20s %-20s %s\n", "step", an, bn, "|difference|"
      n = na > nb ? na : nb
      for (i = 0; i < n; i++) {
        x = (i in a) ? a[i] : "-"
        y = (i in b) ? b[i] : "-"
        if (number(x) && number(y)) {
          d = x - y
          if (d < 0) d = -d
          if (d > worst) { worst = d; at = i }
          note = sprintf("%.2e%s", d, d > t ? "  over " tol : "")
        } else {
          note = "not comparable"
          if (bad == "") bad = sprintf("step %d: %s against %s", i, x, y)
        }
        printf "   %4d  %-20s %-20s %s\n", i, x, y, note
      }
      detail = sprintf("largest |difference| %.2e at step %d (tolerance %s, %d steps)", worst, at, tol, n)
      if (na != steps || nb != steps)
        print "FAIL " sprintf("%d and %d steps, expected %d", na, nb, steps)
      else if (bad != "")
        print "FAIL a loss that is not a number (" bad ")"
      else if (worst > t)
        print "FAIL " detail
      else
        print "PASS " detail
    }' "$3" file=2 "$5"
}

# check_curve LABEL TOL RUN REF: a PASS/FAIL line for RUN's loss curve against REF's.
check_curve() {
  local label="$1" tol="$2" name="$3" ref="$4" out verdict
  if [[ "${run_rc[$name]:-skip}" == skip ]]; then
    result FAIL "$label" "not run: the ${BUDGET}s time budget was spent before it"
    return
  fi
  case "${run_rc[$name]}" in
    0) ;;
    124 | 137)
      result FAIL "$label" "the $name run timed out"
      return
      ;;
    *)
      result FAIL "$label" "the $name run failed (exit status ${run_rc[$name]}, stderr above)"
      return
      ;;
  esac
  if [[ "${run_rc[$ref]:-skip}" != 0 ]]; then
    result FAIL "$label" "the reference run $ref failed or did not run"
    return
  fi
  say "-- $label"
  out="$(compare_losses "$tol" "$name" "$work/$name.out" "$ref" "$work/$ref.out")"
  verdict="${out##*$'\n'}"
  say "${out%$'\n'*}"
  result "${verdict%% *}" "$label" "${verdict#* }"
}

# tokens/s over the steps after the first (weighted by time, as train_llama's summary does),
# from the JSON's step_time_s and tokens_per_s. Fails when the JSON lacks them.
json_tokens_per_s() {
  awk '
    function field(s, k,   m) {
      if (match(s, "\"" k "\":[^,}]*")) return substr(s, RSTART + length(k) + 3, RLENGTH - length(k) - 3)
      return ""
    }
    /^\{/ {
      t = field($0, "step_time_s"); r = field($0, "tokens_per_s")
      if (t == "" || r == "") { missing = 1; next }
      n++
      if (n == 1) { t1 = t; r1 = r; next }
      tokens += r * t; time += t
    }
    END {
      if (missing || n == 0) exit 1
      if (n == 1) { tokens = r1 * t1; time = t1 }
      if (time <= 0) exit 1
      printf "%.0f\n", tokens / time
    }' "$1"
}

report() {
  local name single="$dev-single-f32" tps steps
  say ""
  say "== report"
  if [[ "${run_rc[$single]:-skip}" == 0 ]]; then
    say "per-step JSON of the single-device $dev run ($single):"
    sed 's/^/  /' "$work/$single.out"
  fi
  printf '%-22s %-8s %-8s %-30s %s\n' run status "wall s" "tokens/s" "peak GPU memory"
  for name in "${runs[@]}"; do
    [[ "${run_rc[$name]}" == skip ]] && {
      printf '%-22s %s\n' "$name" "skipped (time budget)"
      continue
    }
    if [[ "$name" == nccl_check ]]; then
      tps="- (bandwidths above)"
    elif tps="$(json_tokens_per_s "$work/$name.out")"; then
      tps="$tps (after step 0)"
    else
      # No timings in the JSON: whole-run wall clock, start-up and kernel compilation included.
      steps="$(grep -c '^{' "$work/$name.out" || true)"
      tps="$(awk -v s="$steps" -v b="$BATCH" -v l="$SEQ_LEN" -v w="${run_wall[$name]}" \
        'BEGIN { if (s > 0 && w > 0) printf "%.0f (wall clock)", s * b * l / w; else print "-" }')"
    fi
    printf '%-22s %-8s %-8s %-30s %s\n' "$name" "${run_rc[$name]}" "${run_wall[$name]}" "$tps" \
      "${run_mem[$name]}"
  done
}

summary() {
  local line
  say ""
  say "== summary"
  for line in "${results[@]}"; do say "$line"; done
  say "$passed passed, $failed failed, $skipped skipped"
}

main() {
  local args=() a
  for a in "$@"; do
    case "$a" in
      -h | --help)
        usage
        exit 0
        ;;
      --cpu) cpu_only=1 ;;
      -*) die "unknown option '$a' (see --help)" ;;
      *) args+=("$a") ;;
    esac
  done
  ((${#args[@]} <= 2)) || die "too many arguments (see --help)"
  mib="${args[1]:-64}"
  [[ "$mib" =~ ^[0-9]+$ ]] || die "the MiB per message must be a whole number, got '$mib'"
  for a in STEPS RUN_TIMEOUT BUDGET; do
    [[ "${!a}" =~ ^[0-9]+$ && "${!a}" -gt 0 ]] || die "$a must be a positive whole number, got '${!a}'"
  done
  command -v timeout >/dev/null 2>&1 || die "'timeout' (coreutils) is needed"
  command -v awk >/dev/null 2>&1 || die "'awk' is needed"

  kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  if [[ "$(basename "$kit")" == scripts && -f "$kit/../Cargo.toml" && ! -e "$kit/train_llama.xz" ]]; then
    repo="$(cd "$kit/.." && pwd)"
    say "== burn-parallel GPU check, from the repository $repo"
  else
    say "== burn-parallel GPU check, kit $kit"
  fi
  [[ "$cpu_only" == 1 ]] && dev=flex

  trap cleanup EXIT
  trap 'exit 130' INT TERM
  if [[ -n "${GPU_CHECK_WORK:-}" ]]; then
    work="$GPU_CHECK_WORK"
    mkdir -p "$work"
    work="$(cd "$work" && pwd)"
  else
    work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
    work_is_temp=1
  fi
  say "work folder: $work"

  [[ -z "$repo" ]] && verify_sums
  if [[ "$cpu_only" == 1 ]]; then
    say "--cpu: every run on --backend flex; no driver, libdevice or NCCL needed"
  else
    check_driver
  fi
  if compgen -G "$kit/*.xz" >/dev/null || [[ "${TRAIN_LLAMA:-}${NCCL_CHECK:-}" == *.xz* ]]; then
    can_decompress || die "the binaries are xz-compressed, but there is no xz and no python3 with" \
      "the lzma module to decompress them: install xz-utils, or decompress them elsewhere (xz -dk)" \
      "and pass TRAIN_LLAMA=... NCCL_CHECK=..."
  fi
  resolve_bin train train_llama "${TRAIN_LLAMA:-}"
  [[ -n "$train" ]] || die "no train_llama: looked for $kit/train_llama.xz and $kit/train_llama" \
    "${repo:+and in $repo/target/release/examples }(set TRAIN_LLAMA, or build the kit with scripts/cuda-build.sh)"
  say "train_llama: $train"
  resolve_bin nccl_check nccl_check "${args[0]:-${NCCL_CHECK:-}}"
  say "nccl_check: ${nccl_check:-none}"
  if [[ "$cpu_only" == 0 ]]; then
    setup_libdevice
    setup_nccl
  fi
  say "time budget ${BUDGET}s, at most ${RUN_TIMEOUT}s per run, $STEPS steps of $BATCH x $SEQ_LEN tokens"

  say ""
  say "== 1. single device: $dev against flex (CPU, f32)"
  train_run flex-ref 0 -- --backend flex --strategy single --world-size 1 --engine threads
  train_run flex-ref-sgd 0 -- --backend flex --strategy single --world-size 1 --engine threads \
    --optimizer sgd
  train_run "$dev-single-f32" 1 -- --backend "$dev" --strategy single --world-size 1 --engine threads
  check_curve "single device, $dev f32 against flex f32, AdamW" "$TOL_ADAMW" "$dev-single-f32" flex-ref
  train_run "$dev-single-sgd" 1 -- --backend "$dev" --strategy single --world-size 1 --engine threads \
    --optimizer sgd
  check_curve "single device, $dev f32 against flex f32, SGD" "$TOL_SGD" "$dev-single-sgd" flex-ref-sgd
  train_run "$dev-single-bf16" 1 -- --backend "$dev" --strategy single --world-size 1 --engine threads \
    --param-dtype bf16
  local bf16="$dev-single-bf16" why
  why="$(grep -m1 '^error:' "$work/$bf16.err" 2>/dev/null || true)"
  if [[ "${run_rc[$bf16]}" != 0 && "${run_rc[$bf16]}" != skip && "$why" == *bf16* ]] &&
    ! grep -q '^{' "$work/$bf16.out"; then
    # train_llama rejected the flags before training: the backend has no bf16.
    result SKIPPED "single device, $dev bf16 against flex f32" "rejected by train_llama: ${why#error: }"
  else
    check_curve "single device, $dev bf16 against flex f32" "$TOL_BF16" "$bf16" flex-ref
  fi

  say ""
  say "== 2. 2 rank threads sharing the GPU (threads engine) against single-device flex"
  local s
  for s in fsdp2 tp; do
    # LOCAL_RANK=0: every rank thread on GPU 0 (else rank r takes GPU r).
    train_run "$dev-$s-2threads" 1 LOCAL_RANK=0 -- --backend "$dev" --strategy "$s" \
      --world-size 2 --engine threads
    check_curve "$s on 2 threads, $dev, against flex single, AdamW" "$TOL_ADAMW" \
      "$dev-$s-2threads" flex-ref
    train_run "$dev-$s-2threads-sgd" 1 LOCAL_RANK=0 -- --backend "$dev" --strategy "$s" \
      --world-size 2 --engine threads --optimizer sgd
    check_curve "$s on 2 threads, $dev, against flex single, SGD" "$TOL_SGD" \
      "$dev-$s-2threads-sgd" flex-ref-sgd
  done

  say ""
  say "== 3. NCCL"
  if [[ "$cpu_only" == 1 ]]; then
    result SKIPPED "NCCL checks" "--cpu"
  elif [[ "$nccl_ok" != 1 ]]; then
    result SKIPPED "NCCL checks (nccl_check, train_llama --engine nccl)" \
      "no libnccl.so or libnccl.so.2 in $nccl_looked (the other checks do not need it)"
  else
    if [[ -z "$nccl_check" ]]; then
      result SKIPPED "nccl_check" "no nccl_check binary (the kit's nccl_check.xz, NCCL_CHECK, or an argument)"
    else
      if run nccl_check 1 env "${NCCL_ENV[@]}" "$nccl_check" --gpus 0 --mib "$mib" --iters 20; then
        cat "$work/nccl_check.out"
        result PASS "nccl_check, 1 rank, $mib MiB" "$(tail -n 1 "$work/nccl_check.out" | sed "s/^nccl_check: //")"
      else
        cat "$work/nccl_check.out"
        case "${run_rc[nccl_check]}" in
          skip) result FAIL "nccl_check" "not run: the ${BUDGET}s time budget was spent before it" ;;
          1) result FAIL "nccl_check, 1 rank, $mib MiB" "a device result differs from the host's" ;;
          2) result FAIL "nccl_check, 1 rank, $mib MiB" "CUDA or NCCL could not be loaded or set up (stderr above)" ;;
          124 | 137) result FAIL "nccl_check, 1 rank, $mib MiB" "timed out" ;;
          *) result FAIL "nccl_check, 1 rank, $mib MiB" "exit status ${run_rc[nccl_check]}" ;;
        esac
      fi
    fi
    train_run "$dev-fsdp2-1thread" 1 -- --backend "$dev" --strategy fsdp2 --world-size 1 --engine threads
    train_run "$dev-fsdp2-nccl" 1 "${NCCL_ENV[@]}" -- --backend "$dev" --strategy fsdp2 \
      --world-size 1 --engine nccl
    check_curve "fsdp2 on 1 rank, nccl engine against threads engine" "$TOL_ENGINE" \
      "$dev-fsdp2-nccl" "$dev-fsdp2-1thread"
  fi

  say ""
  say "== 4. compile (Burn's kernel fusion) against eager"
  if [[ "$cpu_only" == 1 ]]; then
    result SKIPPED "compile checks" "--cpu (flex has no kernel fusion)"
  else
    printf 'enable_compile: true\n' > "$work/compile.yaml"
    train_run "$dev-single-sgd-compile" 1 -- --backend "$dev" --strategy single --world-size 1 \
      --engine threads --optimizer sgd --distributed-config "$work/compile.yaml"
    check_curve "single device, $dev compiled against eager, SGD" "$TOL_SGD" \
      "$dev-single-sgd-compile" "$dev-single-sgd"
    if [[ "$nccl_ok" == 1 ]]; then
      train_run "$dev-fsdp2-nccl-compile" 1 "${NCCL_ENV[@]}" -- --backend "$dev" --strategy fsdp2 \
        --world-size 1 --engine nccl --distributed-config "$work/compile.yaml"
      check_curve "fsdp2 on 1 rank, nccl engine, compiled against eager" "$TOL_ADAMW" \
        "$dev-fsdp2-nccl-compile" "$dev-fsdp2-nccl"
    fi
  fi

  report
  summary
  say "total $((SECONDS - start_s))s"
  ((failed == 0)) || exit 1
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
