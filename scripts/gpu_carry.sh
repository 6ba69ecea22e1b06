#!/usr/bin/env bash
# Build .gpucarry/: what scripts/gpu_check.sh needs on a GPU machine that has CUDA PyTorch but no
# network and no bcc. Run it HERE (Debian 12, with package registries), then carry .gpucarry along.
#
#   scripts/gpu_carry.sh [--with-duckdb] [--no-bpf] [--python-version 3.12]
#
#   wheels/   cupti-python (cp312, CUPTI 13.0 like the machine's torch cu130) and pyelftools;
#             duckdb too with --with-duckdb (19.5 MiB: it does not fit beside bcc, see docs/gpu-check.md)
#   bcc/      Debian 12's python3-bpfcc, libbpfcc, libllvm14, libclang-cpp14, libz3-4, libbpf1, libelf1
#             (unpacked there with `dpkg -x` into a private prefix, never into /)
#   kheaders.tar.xz  one merged kernel header tree (Debian's 6.1 common + amd64 headers, include/ and
#             arch/x86 only) for bcc via BCC_KERNEL_SOURCE, since the machine's 6.18 kernel ships none
#
# It prints each part's size and the total that would travel (tracked + untracked files + .gpucarry)
# against the device tool's 64 MiB limit, and adds .gpucarry to .git/info/exclude so it is carried only
# when named (carry: [".gpucarry"]).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$REPO/.gpucarry
PYVER=3.12
WITH_DUCKDB=0
WITH_BPF=1
CUPTI_PYTHON=cupti-python==13.0.1  # CUPTI 13.0: the machine's torch is cu130 with a CUDA 13.0 driver
DUCKDB=duckdb==1.4.4
LIMIT_MIB=64
while [ $# -gt 0 ]; do
  case "$1" in
    --with-duckdb) WITH_DUCKDB=1 ;;
    --no-bpf) WITH_BPF=0 ;;
    --python-version) PYVER=$2; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu_carry: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "gpu_carry: $*"; }
mib() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }

rm -rf "$DEST" && mkdir -p "$DEST/wheels"
grep -qx '/.gpucarry/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpucarry/' >>"$REPO/.git/info/exclude"

PIP=("$REPO/.venv/bin/python" -m pip)
[ -x "$REPO/.venv/bin/python" ] || PIP=(python3 -m pip)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WHEELS=("$CUPTI_PYTHON" pyelftools)
[ "$WITH_DUCKDB" -eq 1 ] && WHEELS+=("$DUCKDB")
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST/wheels" "${WHEELS[@]}"
say "wheels: $(ls "$DEST/wheels" | tr '\n' ' ') = $(mib "$DEST/wheels") MiB"

if [ "$WITH_BPF" -eq 1 ]; then
  mkdir -p "$DEST/bcc"
  (cd "$DEST/bcc" && apt-get download -q python3-bpfcc libbpfcc libllvm14 libclang-cpp14 libz3-4 libbpf1 libelf1 \
     >/dev/null 2>&1) || { say "apt-get download failed (is this Debian 12 with its package mirror?)"; exit 1; }
  say "bcc packages: $(ls "$DEST/bcc" | wc -l) .deb = $(mib "$DEST/bcc") MiB"
  COMMON=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
  ARCH=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
  [ -n "$COMMON" ] && [ -n "$ARCH" ] || { say "no Debian kernel headers under /usr/src (scripts/setup.sh installs them)"; exit 1; }
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  mkdir -p "$TMP/kernel/arch"
  cp -a "$COMMON/include" "$TMP/kernel/" && cp -a "$COMMON/arch/x86" "$TMP/kernel/arch/"
  cp -a "$ARCH/include" "$ARCH/arch" "$ARCH/.config" "$TMP/kernel/"  # generated headers over the common ones
  cp -a "$COMMON/Makefile" "$TMP/kernel/Makefile"
  tar -C "$TMP" -cJf "$DEST/kheaders.tar.xz" kernel
  say "kernel headers: $(basename "$COMMON") + $(basename "$ARCH") -> kheaders.tar.xz = $(mib "$DEST/kheaders.tar.xz") MiB"
fi

TREE=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n1 | awk '{printf "%.1f", $1 / 1048576}')
CARRY=$(mib "$DEST")
TOTAL=$(awk -v a="$TREE" -v b="$CARRY" 'BEGIN {printf "%.1f", a + b}')
say "working tree $TREE MiB + .gpucarry $CARRY MiB = $TOTAL MiB of the ${LIMIT_MIB} MiB a device call carries"
if awk -v t="$TOTAL" -v l="$LIMIT_MIB" 'BEGIN {exit !(t > l)}'; then
  say "OVER the limit: drop --with-duckdb or use --no-bpf (gpu_check.sh then skips what is missing)"
  exit 3
fi
