#!/usr/bin/env bash
# The GPU check: one script for a fresh GPU machine that has CUDA PyTorch and no network.
#
#   scripts/gpu_check.sh [--dry-run] [--rehearse] [-- ARGS for scripts/gpu_check.py]
#
# It prepares what the machine lacks from what was carried in .gpucarry/ (made here by
# scripts/gpu_carry.sh: cupti-python and pyelftools wheels, Debian's bcc + LLVM packages unpacked with
# `dpkg -x` into a private prefix, a kernel header tree for bcc), stages the llmobs package from this
# checkout (no install), then runs scripts/gpu_check.py: preflight (GPU, driver, torch CUDA, whether
# this kernel runs eBPF at all), NVML, tokens/s with vs without the agent, `trace --steps 8` with
# `attach --profile cuda` beside it (kernels captured and joined to steps, uprobe launch counts vs
# CUPTI, clock-fit residual), and the tests/gpu tier. Every result goes to ONE file:
# $OUT/gpu_check.txt ($OUT defaults to out/gpu-check). Each part is reported RAN, SKIPPED (with the
# reason) or FAILED; the script never stops at the first missing piece.
#
#   --dry-run   stop right after the environment checks (the unit tests run this on GPU-less hosts)
#   --rehearse  run everything on the CPU (tiny model, cpu probe profile): exercises the script here
#   LLMOBS_USE_CARRY=1  use the carried bcc and headers even where the machine has its own (to test them)
#
# Exit codes: 0 all parts that could run passed; 1 a part failed; 2 usage; 10 no GPU here (and not
# --rehearse). See docs/gpu-check.md.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/out/gpu-check}
RESULTS=$OUT/gpu_check.txt
CARRY=${LLMOBS_CARRY:-$REPO/.gpucarry}
STAGE=${LLMOBS_STAGE:-${TMPDIR:-/tmp}/llmobs-gpu-stage}
LIMIT_S=${LLMOBS_GPU_CHECK_TIMEOUT:-290}
DRY=0
REHEARSE=0
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --rehearse) REHEARSE=1 ;;
    --) shift; PASS=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
: >"$RESULTS"
say() { echo "$*" | tee -a "$RESULTS"; }

say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), kernel $(uname -r)"
say "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"

# --- 1. is there a GPU at all ------------------------------------------------------------------------
if [ -e /dev/nvidia0 ]; then
  say "gpu: /dev/nvidia0 present"
elif [ "$REHEARSE" -eq 1 ]; then
  say "gpu: none (/dev/nvidia0 absent); --rehearse: running the checks on the CPU"
else
  say "gpu_check: no GPU (/dev/nvidia0 absent): nothing to check on this host"
  exit 10
fi
if [ "$DRY" -eq 1 ]; then
  say "gpu_check: --dry-run: stopping before the checks"
  exit 0
fi

# --- 2. python: the machine's own (the one with CUDA torch), or this checkout's venv when rehearsing --
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ "$REHEARSE" -eq 1 ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python
  else PYTHON=$(command -v python3 || true); fi
fi
[ -n "$PYTHON" ] || { say "gpu_check: no python3 on PATH"; exit 1; }
say "python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"

# --- 3. what was carried --------------------------------------------------------------------------------
rm -rf "$STAGE" && mkdir -p "$STAGE/site" "$STAGE/py" "$STAGE/bcc"
PYPATH=$STAGE/py
if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
  PYPATH=$PYPATH:$STAGE/site
  for whl in "$CARRY"/wheels/*.whl; do  # one at a time: a wheel for another python must not block the rest
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STAGE/site" \
        "$whl" >>"$RESULTS" 2>&1; then
      say "carry: installed $(basename "$whl")"
    else
      say "carry: pip could not install $(basename "$whl") (see above)"
    fi
  done
else
  say "carry: no wheels in $CARRY/wheels (cupti-python must then be on the machine already)"
fi

BCC_NOTE=""
if [ -z "${LLMOBS_USE_CARRY:-}" ] && "$PYTHON" -c 'import bcc' 2>/dev/null; then
  BCC_NOTE="bcc: the machine's own"
elif compgen -G "$CARRY/bcc/*.deb" >/dev/null; then
  if command -v dpkg >/dev/null; then
    for deb in "$CARRY"/bcc/*.deb; do dpkg -x "$deb" "$STAGE/bcc" || say "carry: dpkg -x failed on $deb"; done
    BCC_LIB=$STAGE/bcc/usr/lib/x86_64-linux-gnu
    export LD_LIBRARY_PATH=$BCC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    PYPATH=$PYPATH:$STAGE/bcc/usr/lib/python3/dist-packages
    MISSING=$(ldd "$BCC_LIB/libbcc.so.0" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
    BCC_NOTE="bcc: carried Debian packages unpacked in $STAGE/bcc${MISSING:+; libraries still missing: $MISSING}"
  else
    BCC_NOTE="bcc: carried, but dpkg is not here to unpack it"
  fi
else
  BCC_NOTE="bcc: absent and not carried (eBPF parts will be skipped)"
fi
say "$BCC_NOTE"

KBUILD=/lib/modules/$(uname -r)/build
if [ -z "${LLMOBS_USE_CARRY:-}" ] && [ -d "$KBUILD/include" ]; then
  say "kernel headers: $KBUILD"
elif [ -f "$CARRY/kheaders.tar.xz" ]; then
  tar -xJf "$CARRY/kheaders.tar.xz" -C "$STAGE" && export BCC_KERNEL_SOURCE=$STAGE/kernel
  say "kernel headers: carried tree at $STAGE/kernel (BCC_KERNEL_SOURCE), none at $KBUILD or LLMOBS_USE_CARRY"
elif [ -f /sys/kernel/kheaders.tar.xz ]; then
  say "kernel headers: the kernel's own /sys/kernel/kheaders.tar.xz (bcc unpacks it)"
else
  say "kernel headers: none for $(uname -r) and none carried (bcc cannot compile; eBPF parts will be skipped)"
fi

# llmobs from this checkout, without installing it: agent/llmobs is `llmobs`, cupti/collector is
# `llmobs.cupti` (the layout pyproject.toml maps; copying keeps NVIDIA's `cupti` unshadowed); the BPF C
# sources come along (package data in llmobs/bpf/c)
cp -a "$REPO/agent/llmobs" "$STAGE/py/llmobs" && rm -rf "$STAGE/py/llmobs/cupti" \
  && cp -a "$REPO/cupti/collector" "$STAGE/py/llmobs/cupti" || { say "gpu_check: cannot stage llmobs"; exit 1; }
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -c 'import llmobs.cupti.collector, llmobs.commands.trace, llmobs.gpu.nvml_source' 2>>"$RESULTS" \
  || { say "gpu_check: the staged llmobs does not import (see above)"; exit 1; }

# --- 4. the checks --------------------------------------------------------------------------------------
ARGS=(--results "$RESULTS")
[ "$REHEARSE" -eq 1 ] && ARGS+=(--rehearse)
timeout "$LIMIT_S" "$PYTHON" "$REPO/scripts/gpu_check.py" "${ARGS[@]}" "${PASS[@]}"
RC=$?
if [ "$RC" -eq 124 ]; then say "gpu_check: stopped after ${LIMIT_S} s (LLMOBS_GPU_CHECK_TIMEOUT); results are partial"; fi
say "gpu_check: exit $RC; results in $RESULTS"
exit "$RC"
