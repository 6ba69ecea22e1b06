"""Protobuf code generated from proto/*.proto by scripts/setup.sh (scripts/gen_proto.py). Never edit."""
