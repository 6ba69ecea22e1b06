"""Checks that only read files under /proc, /sys and /lib/modules: privileges, BTF, kernel headers,
tracefs. Every read goes through `Context.path`, so unit tests point them at fake files."""

from __future__ import annotations

import os
from pathlib import Path

from llmobs.hostcheck.model import Context, Finding, Status

# Capability bit numbers from linux/capability.h.
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

RUN_AS_ROOT = "run as root (sudo llmobs-agent ...), or grant CAP_BPF and CAP_PERFMON"

BTF_MAGIC = b"\x9f\xeb"  # 0xeB9F, little-endian, at the start of every BTF blob


def parse_status(text: str) -> dict[str, str]:
    """/proc/PID/status as a dict of field -> raw value."""
    fields = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    return fields


def cap_names(cap_eff: int) -> list[str]:
    """The eBPF-relevant capabilities set in a CapEff mask."""
    names = []
    for bit, name in ((CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if cap_eff >> bit & 1:
            names.append(name)
    return names


def read_privileges(ctx: Context) -> tuple[int, int]:
    """(effective uid, CapEff mask) of this process, from /proc/self/status."""
    fields = parse_status(ctx.path("/proc/self/status").read_text())
    euid = int(fields["Uid"].split()[1])
    return euid, int(fields["CapEff"], 16)


def can_load_bpf(cap_eff: int) -> bool:
    """Loading programs and attaching uprobes needs CAP_BPF + CAP_PERFMON (5.8+) or CAP_SYS_ADMIN."""
    has = set(cap_names(cap_eff))
    return {"CAP_BPF", "CAP_PERFMON"} <= has or "CAP_SYS_ADMIN" in has


def bpf_privileges(ctx: Context) -> tuple[bool, str]:
    """Whether this process may load BPF programs, and a short reason when it may not."""
    try:
        euid, cap_eff = read_privileges(ctx)
    except (OSError, KeyError, ValueError, IndexError) as exc:
        return False, f"cannot read /proc/self/status ({exc})"
    if can_load_bpf(cap_eff):
        return True, ""
    return False, f"uid {euid} without CAP_BPF and CAP_PERFMON"


def check_privileges(ctx: Context) -> Finding:
    euid, cap_eff = read_privileges(ctx)
    names = cap_names(cap_eff)
    caps = ", ".join(names) if names else "none of CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN"
    detail = f"{'root' if euid == 0 else f'uid {euid}'}; CapEff {cap_eff:016x}: {caps}"
    if not can_load_bpf(cap_eff):
        return Finding(Status.MISSING, detail, RUN_AS_ROOT)
    if euid != 0:
        # The capabilities load programs, but reading another user's /proc/PID/maps and tracefs
        # needs more (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH); root has them all.
        return Finding(
            Status.DEGRADED,
            detail,
            "other users' processes need CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH too; root has all",
        )
    return Finding(Status.OK, detail)


def check_btf(ctx: Context) -> Finding:
    path = ctx.path("/sys/kernel/btf/vmlinux")
    hint = "optional for llmobs (bcc compiles against headers); enable CONFIG_DEBUG_INFO_BTF for CO-RE tools"
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        size = path.stat().st_size
    except FileNotFoundError:
        return Finding(Status.MISSING, "no /sys/kernel/btf/vmlinux: kernel built without BTF", hint)
    if magic != BTF_MAGIC:
        return Finding(Status.DEGRADED, f"/sys/kernel/btf/vmlinux has bad magic {magic.hex()}", hint)
    return Finding(Status.OK, f"/sys/kernel/btf/vmlinux ({size / 2**20:.1f} MiB)")


def kernel_release(ctx: Context) -> str:
    return ctx.path("/proc/sys/kernel/osrelease").read_text().strip()


def resolve_in_root(ctx: Context, absolute: str) -> Path | None:
    """Follow symlinks of `absolute` inside the context's root (absolute link targets are taken
    relative to the root, as the kernel would in a chroot). None when it does not exist."""
    current = absolute
    for _ in range(16):
        path = ctx.path(current)
        if path.is_symlink():
            target = os.readlink(path)
            current = (
                target if target.startswith("/") else os.path.normpath(f"{os.path.dirname(current)}/{target}")
            )
            continue
        return path if path.exists() else None
    return None


def headers_release(build: Path) -> str | None:
    """The release a headers tree was built for (what `uname -r` says on its kernel), or None.

    utsrelease.h comes first: it holds UTS_RELEASE, the string the kernel reports; Debian's
    include/config/kernel.release holds the upstream version instead (6.1.192 for 6.1.0-57-amd64).
    """
    uts = build / "include" / "generated" / "utsrelease.h"
    if uts.is_file():
        # #define UTS_RELEASE "6.1.0-57-amd64"
        text = uts.read_text()
        if text.count('"') >= 2:
            return text.split('"')[1]
    release_file = build / "include" / "config" / "kernel.release"
    if release_file.is_file():
        return release_file.read_text().strip()
    name = build.name
    return name.removeprefix("linux-headers-") if name.startswith("linux-headers-") else None


def check_kernel_headers(ctx: Context) -> Finding:
    release = kernel_release(ctx)
    build_link = f"/lib/modules/{release}/build"
    install_hint = f"install linux-headers-{release}, or run scripts/setup.sh (it links the nearest headers)"
    build = resolve_in_root(ctx, build_link)
    if build is None:
        if ctx.path("/sys/kernel/kheaders.tar.xz").exists():
            return Finding(Status.OK, f"no {build_link}; bcc uses the kernel's built-in headers (kheaders)")
        return Finding(Status.MISSING, f"no {build_link} and no /sys/kernel/kheaders.tar.xz", install_hint)
    built_for = headers_release(build)
    shown = "/" + str(build.relative_to(ctx.root)) if build.is_relative_to(ctx.root) else str(build)
    if built_for is None:
        return Finding(Status.DEGRADED, f"{build_link} -> {shown}: cannot tell its release", install_hint)
    if built_for == release:
        return Finding(Status.OK, f"{shown} match the running kernel {release}")
    # A substitute is fine for llmobs: its programs read user memory and tracepoint fields (whose
    # layout bcc takes from tracefs), never kernel structs, which is where a mismatch would bite.
    how = "linked by scripts/setup.sh" if ctx.path(build_link).is_symlink() else "not a link"
    return Finding(
        Status.OK,
        f"substituted: {shown} (release {built_for}) for running {release}, {how}; "
        "fine for llmobs, which reads no kernel structs",
    )


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """(mount point, fs type) pairs from /proc/mounts."""
    pairs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            pairs.append((parts[1], parts[2]))
    return pairs


def check_tracefs(ctx: Context) -> Finding:
    mounts = parse_mounts(ctx.path("/proc/mounts").read_text())
    points = [point for point, fstype in mounts if fstype == "tracefs"]
    if not points:
        return Finding(
            Status.MISSING,
            "tracefs is not mounted",
            "mount -t tracefs nodev /sys/kernel/tracing (scripts/setup.sh does this)",
        )
    if "/sys/kernel/tracing" not in points and "/sys/kernel/debug/tracing" not in points:
        return Finding(
            Status.DEGRADED,
            f"tracefs only at {', '.join(points)}",
            "bcc looks in /sys/kernel/tracing or /sys/kernel/debug/tracing; mount it there",
        )
    return Finding(Status.OK, "mounted at " + ", ".join(points))
