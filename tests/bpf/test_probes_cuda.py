"""The cuda profile's real code path without a GPU: a stand-in libcuda.so.1, compiled here from C
with the driver API's names and signatures, loaded by a real PyTorch process. Resolution through
/proc/PID/maps, placement, the templated entry/return programs, tags and exact counts all run for
real; only the library behind the symbols is not NVIDIA's."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from llmobs.bpf.profiles import PROBE_IDS
from llmobs.bpf.session import AttachSession, Options
from test_probes_target import Target

FAKE_LIBCUDA = r"""
#include <stddef.h>
volatile unsigned long sink;
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shm, void *stream, void **params, void **extra)
{ sink += gx; return 0; }
int cuMemAlloc_v2(unsigned long *dptr, size_t bytes) { *dptr = 4096; sink += bytes; return 0; }
int cuStreamSynchronize(void *stream) { for (int i = 0; i < 1000; i++) sink += i; return 0; }
"""
NAMES = {index: name for name, index in PROBE_IDS.items()}


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory):
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.fail("a C compiler is needed to build the stand-in libcuda (scripts/setup.sh installs gcc)")
    work = tmp_path_factory.mktemp("cuda")
    (work / "fake.c").write_text(FAKE_LIBCUDA)
    library = work / "libcuda.so.1"
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(work / "fake.c")], check=True
    )
    return library


def test_cuda_profile_resolves_attaches_and_counts(libcuda):
    with Target("--cuda-lib", str(libcuda)) as target:
        session = AttachSession(target.pid, Options(profiles=("cuda",)))
        session.start()
        attached = {probe.name for probe in session.attached_probes}
        skipped = {s.probe.name: s.reason for s in session.skipped}
        target.cuda(1, f"{7:032x}", launches=5, alloc_bytes=1 << 20, syncs=2)
        target.cuda(2, f"{8:032x}", launches=3, alloc_bytes=4096, syncs=1)
        events, final = session.close()
    # the three symbols the stand-in defines are attached; the rest are reported, not fatal
    assert {"cuLaunchKernel", "cuMemAlloc_v2", "cuStreamSynchronize"} <= attached
    assert "symbol cuGraphLaunch not found in libcuda.so.1" in skipped["cuGraphLaunch"]
    assert "no library matching" in skipped["cudaLaunchKernel"]  # no libcudart in this process
    totals = {(NAMES[probe], step): value for (_, probe, step), value in final["totals"].items()}
    assert totals[("cuLaunchKernel", 1)][0] == 5 and totals[("cuLaunchKernel", 2)][0] == 3
    assert totals[("cuMemAlloc_v2", 1)][:2] == [1, 1 << 20] and totals[("cuMemAlloc_v2", 2)][:2] == [1, 4096]
    assert totals[("cuStreamSynchronize", 1)][0] == 2 and totals[("cuStreamSynchronize", 1)][2] > 0
    kinds = {NAMES[int(p)]: int(k) for p, k in zip(events["probe"], events["kind"], strict=True)}
    assert kinds["cuLaunchKernel"] == 1 and kinds["cuMemAlloc_v2"] == 0  # gpu, mem
    assert set(events["step_seq"].tolist()) == {1, 2}
    assert all(
        lo == step + 6
        for lo, step in zip(events["trace_id_lo"].tolist(), events["step_seq"].tolist(), strict=True)
    )
