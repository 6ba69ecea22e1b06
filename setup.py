"""The build steps pyproject.toml cannot declare:

- the protobuf code is generated into the package being built (it is never committed), so
  `pip install .` from a clean checkout ships llmobs._proto;
- the OTEP 4947 thread-context library (agent/llmobs/shm/c/otel_thread_ctx.c: the TLS symbol
  otel_thread_ctx_v1 in .dynsym, and a CPython extension module when Python's headers are there) is
  compiled to llmobs/shm/c/libllmobs_otel_thread_ctx.so, the one file llmobs.shm.thread_ctx loads.
  An editable install (scripts/setup.sh) builds it in the source tree. It is optional: without a C
  compiler the install still succeeds, with a warning, and the workload publishes no thread context
  (`llmobs-agent doctor` says so).
- the OTLP encoder's gather (agent/llmobs/otlp/c/wire_gather.c) is compiled to the extension module
  llmobs.otlp._wire_gather. Optional too: without it llmobs.otlp.wire gathers with numpy, to the same
  bytes at more CPU per span (wire.gather_backend() says which).
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
THREAD_CTX = "llmobs.shm.c.libllmobs_otel_thread_ctx"  # -> llmobs/shm/c/libllmobs_otel_thread_ctx.so
THREAD_CTX_SOURCE = "agent/llmobs/shm/c/otel_thread_ctx.c"
WIRE_GATHER = "llmobs.otlp._wire_gather"
WIRE_GATHER_SOURCE = "agent/llmobs/otlp/c/wire_gather.c"
EVENT_SPLIT = "llmobs.store._event_split"
EVENT_SPLIT_SOURCE = "agent/llmobs/store/c/event_split.c"
C_HEADERS = "agent/llmobs/c"  # blake2b_64.h: the span-id hash both C sources compute
OPTIONAL = {  # extension -> what goes without it, for the warning a failed build prints
    THREAD_CTX: "the OTEP 4947 thread-context library was not built ({exc}); instrumented processes "
    "publish no thread context",
    WIRE_GATHER: "the OTLP encoder's C gather was not built ({exc}); OTLP export gathers with numpy, "
    "at more CPU per span",
    EVENT_SPLIT: "the store's C ingest decoder was not built ({exc}); ring records are decoded with numpy, "
    "at more CPU per event",
}


class BuildPyWithProto(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install imports the tree's own, made by scripts/setup.sh
            return
        out = Path(self.build_lib) / "llmobs" / "_proto"
        generate = [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(out)]
        subprocess.run(generate, check=True)


class BuildExtensions(build_ext):
    """Names the thread-context library as thread_ctx.py expects it (no interpreter tag: ctypes opens it
    by path, and it is one file for both faces), and turns a failed build of an optional extension into
    a warning."""

    def get_ext_filename(self, fullname):
        filename = super().get_ext_filename(fullname)
        if fullname.rsplit(".", 1)[-1] != THREAD_CTX.rsplit(".", 1)[-1]:
            return filename
        head, tail = os.path.split(filename)
        return os.path.join(head, tail.split(".", 1)[0] + ".so")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, no libc headers: the agent works without either
            if ext.name not in OPTIONAL:
                raise
            print(
                f"WARNING: llmobs-agent: {OPTIONAL[ext.name].format(exc=exc)}. Install gcc and the Python "
                "headers (Debian: apt-get install gcc libc6-dev python3-dev) and reinstall to build it.",
                file=sys.stderr,
            )


def thread_ctx_extension() -> Extension:
    # Python.h present: the same .so is also the CPython extension (its METH_FASTCALL step is the
    # cheaper per-step call); absent: the ctypes-only library (thread_ctx.py falls back to ctypes)
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    macros = [("LLMOBS_PYTHON_EXTENSION", None)] if python_h.exists() else []
    return Extension(
        THREAD_CTX,
        sources=[THREAD_CTX_SOURCE],
        include_dirs=[C_HEADERS],
        depends=[f"{C_HEADERS}/blake2b_64.h"],
        define_macros=macros,
        # TLSDESC, the TLS model OTEP 4947 recommends to writers (see the source's header comment)
        extra_compile_args=["-O2", "-mtls-dialect=gnu2", "-Wall", "-Wextra"],
        optional=True,
        py_limited_api=True,  # the extension part is stable-ABI (Py_LIMITED_API 3.11)
    )


def wire_gather_extension() -> Extension:
    return Extension(
        WIRE_GATHER,
        sources=[WIRE_GATHER_SOURCE],
        include_dirs=[C_HEADERS],
        depends=[f"{C_HEADERS}/blake2b_64.h"],
        extra_compile_args=["-O2", "-Wall", "-Wextra"],
        optional=True,
        py_limited_api=True,  # Py_LIMITED_API 3.11, as the source defines
    )


def event_split_extension() -> Extension:
    return Extension(
        EVENT_SPLIT,
        sources=[EVENT_SPLIT_SOURCE],
        extra_compile_args=["-O2", "-Wall", "-Wextra"],
        optional=True,
        py_limited_api=True,  # Py_LIMITED_API 3.11, as the source defines
    )


setup(
    cmdclass={"build_py": BuildPyWithProto, "build_ext": BuildExtensions},
    ext_modules=[thread_ctx_extension(), wire_gather_extension(), event_split_extension()],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
