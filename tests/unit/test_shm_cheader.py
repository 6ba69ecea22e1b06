"""bpf/c/llmobs_abi.h must be exactly what the layout generates, and C must agree on every offset."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from llmobs.shm import cheader, layout


def test_header_on_disk_is_the_generated_one():
    on_disk = cheader.HEADER_PATH.read_text()
    drifted = "bpf/c/llmobs_abi.h drifted: run `python -m llmobs.shm.cheader --write`"
    assert on_disk == cheader.render(), drifted
    assert cheader.main(["--check"]) == 0


def test_check_mode_fails_on_drift(tmp_path, monkeypatch):
    drifted = tmp_path / "llmobs_abi.h"
    drifted.write_text(cheader.render().replace("__u64 step_seq;", "__u32 step_seq;", 1))
    monkeypatch.setattr(cheader, "HEADER_PATH", drifted)
    assert cheader.main(["--check"]) == 1


def test_agreed_names_are_kept():
    text = cheader.render()
    assert "#define LLMOBS_CTX_OFFSET           256 " in text
    cell = re.search(r"struct llmobs_ctx_cell \{(.*?)\};", text, re.S).group(1)
    fields = re.findall(r"__u(?:64|32) (\w+(?:\[\d+\])?);", cell)
    # the first four words are what the BPF programs read (bpf/c/llmobs_events.h); v3 added the last four
    assert fields == [
        "seq",
        "trace_id_hi",
        "trace_id_lo",
        "step_seq",
        "tenant_hash",
        "session_hash",
        "rows",
        "flags",
        "tokens",
        "reserved",
    ]


def test_v2_layout_is_derived_unchanged():
    """The reader's v2 layout (fields added later turned back into reserved words) hashes to the value
    every v2 writer stamped into its maps."""
    assert layout.LAYOUT_HASHES[2] == 0xF3D8802A8F2A97B4
    assert layout.LAYOUT_HASHES[3] == layout.LAYOUT_HASH
    v2 = {s.c_name: s for s in layout.layout_for(2)}
    assert "llmobs_request_record" not in v2
    assert (
        v2["llmobs_step_record"].fields[-1].name == "reserved"
        and v2["llmobs_step_record"].fields[-1].count == 1
    )
    assert v2["llmobs_header"].fields[-1].count == 4 and v2["llmobs_ctx_cell"].fields[-1].count == 2


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_gcc_sees_the_same_offsets_and_sizes(tmp_path):
    lines = ["#include <stdio.h>", "#include <linux/types.h>", '#include "llmobs_abi.h"', "int main(void) {"]
    for s in layout.STRUCTS:
        lines.append(f'printf("{s.c_name} size %zu\\n", sizeof(struct {s.c_name}));')
        for f in s.fields:
            lines.append(
                f'printf("{s.c_name}.{f.name} %zu\\n", __builtin_offsetof(struct {s.c_name}, {f.name}));'
            )
    lines.append('printf("ctx_offset %d\\n", LLMOBS_CTX_OFFSET);')
    lines.append('printf("magic %llu\\n", (unsigned long long)LLMOBS_MAGIC);')
    lines.append("return 0; }")
    src = tmp_path / "offsets.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "offsets"
    include = str(cheader.HEADER_PATH.parent)
    subprocess.run(["gcc", "-Wall", "-Werror", "-I", include, "-o", str(exe), str(src)],
                   check=True)  # fmt: skip
    out = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run([str(exe)], capture_output=True, text=True).stdout.splitlines()
    )
    expected = {}
    for s in layout.STRUCTS:
        expected[f"{s.c_name} size"] = s.size
        for f in s.fields:
            expected[f"{s.c_name}.{f.name}"] = s.offsets[f.name]
    expected["ctx_offset"] = layout.CTX_OFFSET
    expected["magic"] = layout.MAGIC
    assert {k: int(v) for k, v in out.items()} == expected
    # and numpy agrees with the same definition
    for s in layout.STRUCTS:
        assert s.dtype.itemsize == s.size
        assert {n: s.dtype.fields[n][1] for n in s.dtype.names} == s.offsets
