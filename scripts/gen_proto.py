"""Compile proto/*.proto into agent/llmobs/_proto/ with grpc_tools.protoc (the generated code is
built, never hand-edited or committed). Rebuilds only what is older than its .proto, so a second
run of scripts/setup.sh changes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "agent" / "llmobs" / "_proto"


def main() -> int:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    stale = []
    for proto in protos:
        out = OUT_DIR / (proto.stem + "_pb2.py")
        if not out.exists() or out.stat().st_mtime < proto.stat().st_mtime:
            stale.append(proto)
    if not stale:
        print(f"[setup] protobuf code up to date ({len(protos)} files in {OUT_DIR.relative_to(ROOT)})")
        return 0
    for proto in stale:
        args = [
            "protoc",
            f"--proto_path={PROTO_DIR}",
            f"--python_out={OUT_DIR}",
            f"--pyi_out={OUT_DIR}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            print(f"[setup] error: protoc failed on {proto}", file=sys.stderr)
            return 1
        print(f"[setup] generated {OUT_DIR.relative_to(ROOT)}/{proto.stem}_pb2.py from proto/{proto.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
