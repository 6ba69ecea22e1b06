"""Profiles, the assembled C unit, and the BPF source conventions (one-line purpose comments)."""

from __future__ import annotations

import re

import pytest
from llmobs.bpf.profiles import DEFAULT_PROFILES, PROBE_IDS, PROBES, parse_profiles, probes_of
from llmobs.bpf.program import BPF_DIR, assemble, ctx_offset


def test_parse_profiles():
    assert parse_profiles("cpu,host") == ("cpu", "host")
    assert parse_profiles(" cuda , host,cuda") == ("cuda", "host")
    with pytest.raises(ValueError, match="gpu"):
        parse_profiles("cpu,gpu")
    with pytest.raises(ValueError):
        parse_profiles("")


def test_default_set_leaves_allocations_out():
    names = {probe.name for probe in probes_of(DEFAULT_PROFILES)}
    assert {"linear", "sched_switch", "page_fault_user", "ioctl"} <= names
    assert not names & {"alloc_cpu", "free_cpu", "sgemm"}


def test_probe_names_unique_and_ids_dense():
    assert len(PROBE_IDS) == len(PROBES)
    assert sorted(PROBE_IDS.values()) == list(range(len(PROBES)))


def test_cuda_profile_covers_the_issue_list():
    names = {probe.name for probe in probes_of(("cuda",))}
    for wanted in (
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuGraphLaunch",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemAllocAsync",
        "cuMemcpyAsync",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cudaLaunchKernel",
        "cudaMemcpyAsync",
        "ncclAllReduce",
    ):
        assert wanted in names


def test_assemble_inlines_each_file_once_and_instantiates_templates():
    text = assemble(probes_of(("cpu", "gemm", "mem", "host", "cuda", "threadctx")))
    assert text.count("---- llmobs_events.h ----") == 1
    assert text.count("---- llmobs_abi.h ----") == 1
    for source in {probe.source for probe in PROBES}:
        assert text.count(f"---- {source}.bpf.c ----") == 1
    assert (
        "LLMOBS_CALL_TIMED(cuStreamSynchronize, LLMOBS_PROBE_cuStreamSynchronize, LLMOBS_KIND_GPU, 0)" in text
    )
    assert (
        "LLMOBS_CALL_POINT(cuMemcpyAsync, LLMOBS_PROBE_cuMemcpyAsync, LLMOBS_KIND_MEM, PT_REGS_PARM3(ctx))"
        in text
    )
    assert f"#define LLMOBS_PROBE_sgemm {PROBE_IDS['sgemm']}" in text
    only_cpu = assemble(probes_of(("cpu",)))
    assert (
        "linear.bpf.c" in only_cpu and "sgemm.bpf.c" not in only_cpu and "sched_switch.bpf.c" not in only_cpu
    )


def test_every_uprobe_program_exists_for_its_probe():
    text = assemble(probes_of(("cpu", "gemm", "mem", "host", "threadctx")))
    for probe in probes_of(("cpu", "gemm", "mem", "host", "threadctx")):
        if probe.hook == "uprobe":
            assert re.search(rf"int uprobe__{probe.name}\(", text)
            returns = probe.timed or probe.optional_duration
            assert bool(re.search(rf"int uretprobe__{probe.name}\(", text)) == returns
            assert bool(re.search(rf"int uprobe__{probe.name}_timed\(", text)) == probe.optional_duration
        for _, fn_name in probe.tracepoints:
            assert re.search(rf"int {fn_name}\(", text)


def test_every_map_and_program_has_a_purpose_comment():
    for path in sorted(BPF_DIR.glob("*.bpf.c")) + [BPF_DIR / "llmobs_events.h"]:
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            if re.match(r"(BPF_\w+\(|int \w+\((struct|void))", line):
                previous = lines[index - 1].strip()
                assert previous.startswith("/*") and previous.endswith("*/"), (
                    f"{path.name}:{index + 1}: {line}"
                )
        assert lines[0].startswith("/*"), f"{path.name} has no header comment"


def test_ctx_offset_comes_from_the_abi_header():
    assert ctx_offset() == 256
