"""Protobuf code generated from proto/*.proto by scripts/gen_proto.py: into the tree by scripts/setup.sh,
into a wheel by setup.py's build step. Never edit, never committed."""
