"""The probe profiles: what each probe hooks, which BPF file implements it, and which are default.

A probe's index in PROBES is its id in the kernel (the `probe` field of events and aggregates), so
the table only ever grows at the end.

The default set (`cpu,host`) was chosen by measurement (docs/probes.md, bench/probes.py):
the GEMM entry (sgemm_) fires 751 times per SmolLM2 token and cost 2.9% tokens/s with one thread even
as a point probe at sgemm_+4, so it sits in the opt-in `gemm` profile (with --gemm-durations for the
timed pair), and the default `cpu` profile probes the linear op above it (211 calls per token).
alloc_cpu/free_cpu fire ~2,950 times per token together and cost several percent: the opt-in `mem`
profile. (The issue's "cpu" profile, split three ways by cost.)
"""

from __future__ import annotations

from dataclasses import dataclass

# libraries by basename: wheels ship their own copies, sometimes with a hash in the name
LIB_C10 = r"^libc10\.so"
LIB_TORCH_CPU = r"^libtorch_cpu\.so"
SYM_LINEAR = "_ZN2at4_ops6linear4callERKNS_6TensorES4_RKSt8optionalIS2_E"  # at::_ops::linear::call
LIB_BLAS = r"^(libtorch_cpu|libmkl_rt|libopenblas[^/]*|libblas)\.so"
LIB_CUDA = r"^libcuda\.so"
LIB_CUDART = r"^libcudart(-[0-9a-f]+)?\.so"
LIB_NCCL = r"^libnccl(-[0-9a-f]+)?\.so"


@dataclass(frozen=True)
class Probe:
    name: str  # the `probe` column; for uprobes the hook's name
    profile: str
    kind: str  # mem | gpu | host | compute
    source: str  # bpf/<source>.bpf.c
    hook: str  # "uprobe" or "tracepoint"
    library: str = ""  # basename regex (uprobes)
    symbol: str = ""  # ELF symbol (uprobes)
    timed: bool = False  # entry + return: events carry a duration
    value: str = "0"  # C expression over ctx for the template probes (uprobe_call.bpf.c)
    tracepoints: tuple[tuple[str, str], ...] = ()  # (category:event, program name)
    # timed only on request (`attach --gemm-durations`): entry uprobe__<name>_timed + uretprobe
    optional_duration: bool = False

    @property
    def templated(self) -> bool:
        return self.source == "uprobe_call"


def _cuda(name: str, library: str, timed: bool, value: str = "0", kind: str = "gpu") -> Probe:
    return Probe(name, "cuda", kind, "uprobe_call", "uprobe", library, name, timed, value)


PROBES: tuple[Probe, ...] = (
    # gemm: the GEMM nn.Linear reaches on this torch build (MKL sgemm_, statically in libtorch_cpu.so)
    Probe("sgemm", "gemm", "compute", "sgemm", "uprobe", LIB_BLAS, "sgemm_", optional_duration=True),
    # mem: every CPU tensor allocation and release (opt-in: ~2,900 hits per SmolLM2 token)
    Probe("alloc_cpu", "mem", "mem", "alloc_cpu", "uprobe", LIB_C10, "_ZN3c109alloc_cpuEm", timed=True),
    Probe("free_cpu", "mem", "mem", "free_cpu", "uprobe", LIB_C10, "_ZN3c108free_cpuEPv"),
    # host
    Probe(
        "sched_switch",
        "host",
        "host",
        "sched_switch",
        "tracepoint",
        tracepoints=(("sched:sched_switch", "tracepoint_sched_switch"),),
    ),
    Probe(
        "page_fault_user",
        "host",
        "host",
        "page_fault_user",
        "tracepoint",
        tracepoints=(("exceptions:page_fault_user", "tracepoint_page_fault_user"),),
    ),
    Probe(
        "ioctl",
        "host",
        "host",
        "sys_ioctl",
        "tracepoint",
        timed=True,
        tracepoints=(
            ("syscalls:sys_enter_ioctl", "tracepoint_sys_enter_ioctl"),
            ("syscalls:sys_exit_ioctl", "tracepoint_sys_exit_ioctl"),
        ),
    ),
    # cuda: driver API (value = bytes for allocations and copies)
    _cuda("cuLaunchKernel", LIB_CUDA, False),
    _cuda("cuLaunchKernelEx", LIB_CUDA, False),
    _cuda("cuGraphLaunch", LIB_CUDA, False),
    _cuda("cuMemAlloc_v2", LIB_CUDA, True, "PT_REGS_PARM2(ctx)", "mem"),
    _cuda("cuMemFree_v2", LIB_CUDA, True, kind="mem"),
    _cuda("cuMemAllocAsync", LIB_CUDA, True, "PT_REGS_PARM2(ctx)", "mem"),
    _cuda("cuMemcpyAsync", LIB_CUDA, False, "PT_REGS_PARM3(ctx)", "mem"),
    _cuda("cuMemcpyHtoDAsync_v2", LIB_CUDA, False, "PT_REGS_PARM3(ctx)", "mem"),
    _cuda("cuMemcpyDtoHAsync_v2", LIB_CUDA, False, "PT_REGS_PARM3(ctx)", "mem"),
    _cuda("cuMemcpyDtoDAsync_v2", LIB_CUDA, False, "PT_REGS_PARM3(ctx)", "mem"),
    _cuda("cuStreamSynchronize", LIB_CUDA, True),
    _cuda("cuCtxSynchronize", LIB_CUDA, True),
    # cuda: runtime API (wheels ship libcudart; PyTorch calls it, not always the driver directly)
    _cuda("cudaLaunchKernel", LIB_CUDART, False),
    _cuda("cudaLaunchKernelExC", LIB_CUDART, False),
    _cuda("cudaGraphLaunch", LIB_CUDART, False),
    _cuda("cudaMalloc", LIB_CUDART, True, "PT_REGS_PARM2(ctx)", "mem"),
    _cuda("cudaFree", LIB_CUDART, True, kind="mem"),
    _cuda("cudaMallocAsync", LIB_CUDART, True, "PT_REGS_PARM2(ctx)", "mem"),
    _cuda("cudaMemcpyAsync", LIB_CUDART, False, "PT_REGS_PARM3(ctx)", "mem"),
    _cuda("cudaStreamSynchronize", LIB_CUDART, True),
    _cuda("cudaDeviceSynchronize", LIB_CUDART, True),
    # cuda: NCCL collectives, timed (value = element count, the third argument)
    _cuda("ncclAllReduce", LIB_NCCL, True, "PT_REGS_PARM3(ctx)"),
    _cuda("ncclAllGather", LIB_NCCL, True, "PT_REGS_PARM3(ctx)"),
    _cuda("ncclReduceScatter", LIB_NCCL, True, "PT_REGS_PARM3(ctx)"),
    _cuda("ncclBroadcast", LIB_NCCL, True, "PT_REGS_PARM3(ctx)"),
    _cuda("ncclReduce", LIB_NCCL, True, "PT_REGS_PARM3(ctx)"),
    _cuda("ncclSend", LIB_NCCL, True, "PT_REGS_PARM2(ctx)"),
    _cuda("ncclRecv", LIB_NCCL, True, "PT_REGS_PARM2(ctx)"),
    # cpu: the linear op above the GEMM, one call per nn.Linear (appended: ids only ever grow)
    Probe("linear", "cpu", "compute", "linear", "uprobe", LIB_TORCH_CPU, SYM_LINEAR),
    # threadctx: the same op, read as a profiler reads OTEP 4947: value = the thread's record's span id
    Probe("thread_span", "threadctx", "host", "thread_span", "uprobe", LIB_TORCH_CPU, SYM_LINEAR),
)

PROBE_IDS = {probe.name: index for index, probe in enumerate(PROBES)}
PROFILES = ("cpu", "gemm", "mem", "host", "cuda", "threadctx")
DEFAULT_PROFILES = ("cpu", "host")


def parse_profiles(text: str) -> tuple[str, ...]:
    """'cpu,host' -> ('cpu', 'host'); 'all' -> every profile; raises ValueError naming the unknown ones."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if "all" in names:
        names = PROFILES
    unknown = [name for name in names if name not in PROFILES]
    if unknown or not names:
        raise ValueError(
            f"unknown profile(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PROFILES)} or all"
        )
    return names


def probes_of(profiles: tuple[str, ...]) -> list[Probe]:
    return [probe for probe in PROBES if probe.profile in profiles]
