"""The doctor's file-reading checks against a fake /proc, /sys and /lib/modules in tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llmobs.hostcheck import Context, Status, gpu, host

ROOT_CAPS = "000001fffeffffff"
RELEASE = "6.18.44-fc-v657"


def write(root: Path, absolute: str, content: str | bytes) -> Path:
    path = root / absolute.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def status_file(uid: int, cap_eff: str) -> str:
    return (
        "Name:\tpython3\nUmask:\t0022\nState:\tR (running)\n"
        f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        f"CapInh:\t0000000000000000\nCapPrm:\t{cap_eff}\nCapEff:\t{cap_eff}\n"
        f"CapBnd:\t{ROOT_CAPS}\nCapAmb:\t0000000000000000\n"
    )


@pytest.fixture
def fake(tmp_path: Path) -> Context:
    write(tmp_path, "/proc/sys/kernel/osrelease", RELEASE + "\n")
    return Context(root=tmp_path)


def caps(*bits: int) -> str:
    return f"{sum(1 << b for b in bits):016x}"


@pytest.mark.parametrize(
    ("uid", "cap_eff", "status", "named"),
    [
        (0, ROOT_CAPS, Status.OK, "CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN"),
        (1000, caps(host.CAP_BPF, host.CAP_PERFMON), Status.DEGRADED, "CAP_BPF, CAP_PERFMON"),
        (0, caps(host.CAP_SYS_ADMIN), Status.OK, "CAP_SYS_ADMIN"),  # pre-5.8 kernels: SYS_ADMIN alone
        (1000, caps(host.CAP_BPF), Status.MISSING, "CAP_BPF"),  # uprobes also need CAP_PERFMON
        (65534, "0000000000000000", Status.MISSING, "none of"),
    ],
)
def test_privileges_from_cap_eff(fake: Context, uid: int, cap_eff: str, status: Status, named: str) -> None:
    write(fake.root, "/proc/self/status", status_file(uid, cap_eff))
    finding = host.check_privileges(fake)
    assert finding.status is status
    assert named in finding.detail
    assert ("root" if uid == 0 else f"uid {uid}") in finding.detail
    if status is Status.MISSING:
        assert "run as root" in finding.hint


def test_bpf_privileges_reason_names_uid(fake: Context) -> None:
    write(fake.root, "/proc/self/status", status_file(65534, "0000000000000000"))
    allowed, why = host.bpf_privileges(fake)
    assert not allowed
    assert "uid 65534" in why


def test_bpf_privileges_unreadable_status_is_a_reason_not_a_crash(fake: Context) -> None:
    allowed, why = host.bpf_privileges(fake)  # no /proc/self/status under the fake root
    assert not allowed
    assert "cannot read /proc/self/status" in why


def test_btf_ok_missing_and_bad_magic(fake: Context) -> None:
    assert host.check_btf(fake).status is Status.MISSING
    path = write(fake.root, "/sys/kernel/btf/vmlinux", host.BTF_MAGIC + b"\x01\x00" + b"\0" * 2**20)
    finding = host.check_btf(fake)
    assert finding.status is Status.OK
    assert "1.0 MiB" in finding.detail
    path.write_bytes(b"\x7fELF")
    assert host.check_btf(fake).status is Status.DEGRADED


def headers_tree(root: Path, dirname: str, uts_release: str) -> Path:
    build = root / "usr/src" / dirname
    write(
        root, f"/usr/src/{dirname}/include/generated/utsrelease.h", f'#define UTS_RELEASE "{uts_release}"\n'
    )
    # Debian's kernel.release holds the upstream version, not what uname -r says: it must not win.
    write(root, f"/usr/src/{dirname}/include/config/kernel.release", "6.1.192\n")
    return build


def link_build(root: Path, target: str) -> None:
    link = root / f"lib/modules/{RELEASE}/build"
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)


def test_headers_substituted_by_a_link_to_another_release(fake: Context) -> None:
    headers_tree(fake.root, "linux-headers-6.1.0-57-amd64", "6.1.0-57-amd64")
    link_build(fake.root, "/usr/src/linux-headers-6.1.0-57-amd64")  # absolute: resolved inside the root
    finding = host.check_kernel_headers(fake)
    assert finding.status is Status.OK
    assert finding.detail.startswith("substituted:")
    assert "release 6.1.0-57-amd64" in finding.detail
    assert f"for running {RELEASE}" in finding.detail
    assert "linked by scripts/setup.sh" in finding.detail


def test_headers_matching(fake: Context) -> None:
    headers_tree(fake.root, f"linux-headers-{RELEASE}", RELEASE)
    link_build(fake.root, f"../../../usr/src/linux-headers-{RELEASE}")  # relative link
    finding = host.check_kernel_headers(fake)
    assert finding.status is Status.OK
    assert "match the running kernel" in finding.detail
    assert "substituted" not in finding.detail


def test_headers_missing_and_kheaders_fallback(fake: Context) -> None:
    finding = host.check_kernel_headers(fake)
    assert finding.status is Status.MISSING
    assert f"linux-headers-{RELEASE}" in finding.hint
    write(fake.root, "/sys/kernel/kheaders.tar.xz", b"\xfd7zXZ")
    assert host.check_kernel_headers(fake).status is Status.OK


def test_headers_dangling_link_is_missing(fake: Context) -> None:
    link_build(fake.root, "/usr/src/linux-headers-gone")
    assert host.check_kernel_headers(fake).status is Status.MISSING


def test_headers_release_unknown_is_degraded(fake: Context) -> None:
    (fake.root / "usr/src/custom").mkdir(parents=True)
    link_build(fake.root, "/usr/src/custom")
    assert host.check_kernel_headers(fake).status is Status.DEGRADED


MOUNTS = (
    "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n"
    "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n"
)


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ("", Status.MISSING),
        ("nodev /sys/kernel/tracing tracefs rw,relatime 0 0\n", Status.OK),
        ("tracefs /sys/kernel/debug/tracing tracefs rw,relatime 0 0\n", Status.OK),
        ("nodev /mnt/trace tracefs rw,relatime 0 0\n", Status.DEGRADED),
    ],
)
def test_tracefs(fake: Context, extra: str, status: Status) -> None:
    write(fake.root, "/proc/mounts", MOUNTS + extra)
    finding = host.check_tracefs(fake)
    assert finding.status is status
    if status is Status.MISSING:
        assert "mount -t tracefs" in finding.hint


LDCONFIG = """\
612 libs found in cache `/etc/ld.so.cache'
\tlibcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12
\tlibcuda.so.1 (libc6,x86-64) => /usr/local/cuda/lib64/stubs/libcuda.so.1
\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so
"""


def test_parse_ldconfig_skips_stubs_and_other_sonames() -> None:
    assert gpu.parse_ldconfig(LDCONFIG, "libcuda.so.1") == ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert gpu.parse_ldconfig(LDCONFIG, "libnvidia-ml.so.1") == []


def test_find_libcuda_from_ldconfig_cache(fake: Context) -> None:
    write(fake.root, "/usr/lib/x86_64-linux-gnu/libcuda.so.1", b"\x7fELF")
    assert gpu.find_libcuda(fake, LDCONFIG) == (
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "the ldconfig cache",
    )


def test_find_libcuda_common_path_when_cache_lacks_it(fake: Context) -> None:
    write(fake.root, "/usr/local/nvidia/lib64/libcuda.so.1", b"\x7fELF")
    assert gpu.find_libcuda(fake, "") == ("/usr/local/nvidia/lib64/libcuda.so.1", "a common driver path")


def test_libcuda_missing_row_says_where_it_looked(fake: Context) -> None:
    write(fake.root, "/usr/local/cuda/lib64/stubs/libcuda.so.1", b"\x7fELF")  # a stub is not a driver
    path, where = gpu.find_libcuda(fake, LDCONFIG)
    assert path is None
    assert "ldconfig" in where
    finding = gpu.check_libcuda(fake)
    assert finding.status is Status.MISSING
    assert "NVIDIA driver" in finding.hint


def test_cuda_driver_not_tried_without_libcuda(fake: Context) -> None:
    finding = gpu.check_cuda_driver(fake)
    assert finding.status is Status.MISSING
    assert "libcuda" in finding.detail


def test_otlp_encoder_row_says_which_parts_are_built(fake: Context, monkeypatch) -> None:
    from llmobs.commands import doctor
    from llmobs.otlp import wire

    if wire.gather_backend() != "c" or wire.span_ids_backend() != "c":
        pytest.skip("the C encoder is not built here (no compiler at install)")
    assert doctor.check_otlp_encoder(fake).status == Status.OK
    monkeypatch.setattr(wire, "_c_step_span_ids", None)
    old_module = doctor.check_otlp_encoder(fake)
    assert old_module.status == Status.DEGRADED and "hashlib" in old_module.detail and old_module.hint
    monkeypatch.setattr(wire, "_c_gather", None)
    none = doctor.check_otlp_encoder(fake)
    assert none.status == Status.DEGRADED and "numpy" in none.detail and "gcc" in none.hint


def test_ingest_decoder_row_says_whether_the_c_decoder_is_built(fake: Context, monkeypatch) -> None:
    from llmobs.commands import doctor
    from llmobs.store import ingest

    if ingest.decoder_backend() != "c":
        pytest.skip("the C decoder is not built here (no compiler at install)")
    assert doctor.check_ingest_decoder(fake).status == Status.OK
    monkeypatch.setattr(ingest, "_event_split", None)
    missing = doctor.check_ingest_decoder(fake)
    assert missing.status == Status.DEGRADED and "numpy" in missing.detail and "gcc" in missing.hint
