"""The OTEP 4719 process-context format as merged (opentelemetry-specification
oteps/profiles/4719-process-ctx.md, 2026-04-07): the header, the mapping names, the payload message.

Header (32 bytes, native byte order, 8-byte aligned), at the start of the mapping:

    0   signature                  char[8]  "OTEL_CTX" (no NUL; compare all 8 bytes)
    8   version                    u32      2 (1 may be used for development)
    12  payload_size               u32      bytes of the encoded payload
    16  monotonic_published_at_ns  u64      CLOCK_BOOTTIME ns; 0 while an update is in progress
    24  payload                    u64      address of the payload in the publisher's address space

Payload: opentelemetry.proto.processcontext.v1development.ProcessContext (opentelemetry-proto v1.11.0):
resource = 1 (the Resource), attributes = 2 (repeated KeyValue; the OTEP's "extra_attributes").
"""

from __future__ import annotations

import struct
from typing import Any

SIGNATURE = b"OTEL_CTX"
VERSION = 2
DEVELOPMENT_VERSION = 1
HEADER = struct.Struct("=8sIIQQ")  # signature, version, payload_size, monotonic_published_at_ns, payload
TIMESTAMP_OFFSET = 16
# What a mapping is called in /proc/PID/maps, by which of memfd_create and prctl(PR_SET_VMA) worked:
# both, prctl only (an anonymous mapping), memfd only. Readers match the start of the name.
MAPPING_NAMES = ("[anon_shmem:OTEL_CTX]", "[anon:OTEL_CTX]", "/memfd:OTEL_CTX")


def _process_context_class():
    """Upstream's generated class when the installed opentelemetry-proto ships it, else ours (the same
    message from proto/otel_process_context.proto). Never both: they would clash in the default pool."""
    try:
        from opentelemetry.proto.processcontext.v1development.process_context_pb2 import ProcessContext
    except ImportError:
        from llmobs._proto.otel_process_context_pb2 import ProcessContext
    return ProcessContext


ProcessContext = _process_context_class()


def _set_value(any_value, value: Any) -> None:
    """AnyValue from a Python value: str, bool, int, float, or a list/tuple of those (array_value)."""
    if isinstance(value, bool):
        any_value.bool_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    elif isinstance(value, float):
        any_value.double_value = value
    elif isinstance(value, list | tuple):
        array = any_value.array_value
        array.SetInParent()  # an empty list is still an array, not an unset value
        for item in value:
            _set_value(array.values.add(), item)
    else:
        any_value.string_value = str(value)


def encode_payload(resource: dict[str, Any], attributes: dict[str, Any] | None = None) -> bytes:
    """ProcessContext{resource: Resource{attributes}, attributes} serialized."""
    message = ProcessContext()
    message.resource.SetInParent()
    for key, value in resource.items():
        kv = message.resource.attributes.add()
        kv.key = key
        _set_value(kv.value, value)
    for key, value in (attributes or {}).items():
        kv = message.attributes.add()
        kv.key = key
        _set_value(kv.value, value)
    return message.SerializeToString()


def python_value(any_value) -> Any:
    """An AnyValue as a Python value (arrays as lists; kvlist as a dict; bytes as bytes)."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [python_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: python_value(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, kind)


def decode_payload(payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(resource attributes, extra attributes) of a ProcessContext. Raises ValueError if undecodable."""
    try:
        message = ProcessContext.FromString(payload)
    except Exception as exc:  # protobuf's DecodeError; its module differs between runtimes
        raise ValueError(f"not a ProcessContext: {exc}") from None
    resource = {kv.key: python_value(kv.value) for kv in message.resource.attributes}
    return resource, {kv.key: python_value(kv.value) for kv in message.attributes}


def decode_draft_payload(payload: bytes) -> dict[str, Any]:
    """The pre-merge draft's payload: a bare opentelemetry.proto.resource.v1.Resource."""
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    try:
        message = Resource.FromString(payload)
    except Exception as exc:
        raise ValueError(f"not a Resource: {exc}") from None
    return {kv.key: python_value(kv.value) for kv in message.attributes}
