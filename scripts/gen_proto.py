"""Compile proto/*.proto into agent/llmobs/_proto/ with grpc_tools.protoc (the generated code is
built, never hand-edited or committed). Rebuilds only what is older than its .proto, so a second
run of scripts/setup.sh changes nothing.

    python scripts/gen_proto.py              into the source tree (scripts/setup.sh, editable installs)
    python scripts/gen_proto.py --out DIR    into DIR: setup.py's build step, the wheel's llmobs/_proto
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "agent" / "llmobs" / "_proto"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="where the _pb2 modules go")
    out_dir = parser.parse_args(argv).out
    protos = sorted(PROTO_DIR.glob("*.proto"))
    stale = []
    for proto in protos:
        out = out_dir / (proto.stem + "_pb2.py")
        if not out.exists() or out.stat().st_mtime < proto.stat().st_mtime:
            stale.append(proto)
    if not stale:
        print(f"[setup] protobuf code up to date ({len(protos)} files in {_shown(out_dir)})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        imports = Path(tmp) / "opentelemetry.pb"
        imports.write_bytes(_opentelemetry_descriptors())
        for proto in stale:
            args = [
                "protoc",
                f"--proto_path={PROTO_DIR}",
                f"--descriptor_set_in={imports}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                str(proto),
            ]
            if protoc.main(args) != 0:
                print(f"[setup] error: protoc failed on {proto}", file=sys.stderr)
                return 1
            print(f"[setup] generated {_shown(out_dir)}/{proto.stem}_pb2.py from proto/{proto.name}")
    return 0


def _opentelemetry_descriptors() -> bytes:
    """A FileDescriptorSet of the installed opentelemetry-proto's common and resource files: what
    proto/otel_process_context.proto imports. The package ships generated code, not .proto sources, so
    protoc gets the descriptors that code carries; the generated module then imports that package."""
    from google.protobuf import descriptor_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2

    files = descriptor_pb2.FileDescriptorSet()
    for module in (common_pb2, resource_pb2):  # dependencies first, as protoc wants them
        module.DESCRIPTOR.CopyToProto(files.file.add())
    return files.SerializeToString()


def _shown(path: Path) -> Path:
    """The path relative to the checkout when it is inside it (setup's lines stay short)."""
    return path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path


if __name__ == "__main__":
    sys.exit(main())
