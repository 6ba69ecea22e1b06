"""OTLP export settings, resolved with the precedence CLI > environment > config file > default.

The environment variables are the standard OTEL_EXPORTER_OTLP_* ones (listed in ENV below, documented in
docs/otlp.md); the config file is TOML with an [otlp] table using the same keys as `OtlpConfig`. The
signal-specific variables (OTEL_EXPORTER_OTLP_TRACES_*) win over the generic ones, as the OpenTelemetry
specification says; a signal-specific HTTP endpoint is used as given, a generic one gets /v1/traces or
/v1/metrics appended.
"""

from __future__ import annotations

import os
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from llmobs import environment
from llmobs.errors import ExitCode, LlmobsError

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
# The largest OTLP trace request sent (its serialised, uncompressed bytes; llmobs.otlp.split cuts a
# batch to fit). 3.5 MiB: under the 4 MiB (4,194,304 bytes) that rotel and the OpenTelemetry
# Collector's gRPC receiver accept by default, with room for a collector that counts a little more.
DEFAULT_MAX_REQUEST_BYTES = 3_670_016
# Below this, ordinary spans would lose events (64 events make a span of about 15 KB).
MIN_MAX_REQUEST_BYTES = 65_536

# Config key -> the environment variables that set it, most specific first.
ENV: dict[str, tuple[str, ...]] = {
    "endpoint": ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    "metrics_endpoint": ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",),
    "protocol": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    "headers": ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"),
    "timeout_s": ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
    "insecure": ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"),
    "certificate": ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE"),
    "client_key": ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY"),
    "client_certificate": (
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    ),
    "compression": ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"),
    "service_name": (environment.OTEL_SERVICE_NAME,),  # the workload reads it too (shm/otel_ctx.py)
    "resource_attributes": ("OTEL_RESOURCE_ATTRIBUTES",),
}
# The env variables whose value is a signal-specific endpoint (used verbatim for HTTP).
_SIGNAL_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


class OtlpConfigError(LlmobsError):
    """A bad OTLP setting (flag, environment variable or config file)."""

    exit_code = ExitCode.USAGE
    default_hint = "see docs/otlp.md for the accepted flags and OTEL_EXPORTER_OTLP_* variables"


@dataclass(frozen=True)
class OtlpConfig:
    endpoint: str | None = None  # None: the protocol's default (localhost:4317 or :4318)
    metrics_endpoint: str | None = None  # None: derived from `endpoint`
    protocol: str = "grpc"
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0
    insecure: bool | None = None  # None: decided by the endpoint's scheme (http -> plaintext)
    certificate: str | None = None  # CA bundle (PEM) to verify the collector
    client_key: str | None = None  # mTLS
    client_certificate: str | None = None
    compression: str = "none"  # none | gzip
    service_name: str = "llmobs"
    resource_attributes: dict[str, str] = field(default_factory=dict)
    trace_id_mode: str = "prompt"  # prompt: the request's prompt-hash trace id; random: per request
    # Token-step spans per batch (memory bound: one batch in flight). A batch's store reads and its
    # commit cost a fixed ~80 ms of DuckDB statements here, so small batches are dear: 512 -> 2,048
    # took the exporter from ~225 to ~92 ms of CPU per 1,000 spans (bench.otlp), for ~+9 MB of peak
    # RSS while a batch is encoded; 4,096 bought nothing more and held +41 MB.
    batch_spans: int = 2048
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a batch larger than this goes as several requests
    sample_n: int = 1  # export the spans of 1 request in N, chosen by the kernel's trace-id hash
    max_events_per_span: int = 64  # sampled probe events kept per token-step span; the rest are counted
    metrics_interval_s: float = 10.0
    settle_s: float = 2.0  # --follow: a step is exported once this old (its late events have landed)
    # --follow: a step whose forward pass has no rollup yet waits for it up to this long (its span's
    # llmobs.step.* attributes). Correlation runs every 2 s, stretched to at most 15 s where a run is
    # dear (pipeline/core.py CORRELATE_MAX_S), and a step reaches the store up to ~3 s after it ran.
    rollup_wait_s: float = 20.0
    request_idle_s: float = 5.0  # --follow: a request with no new step for this long is closed
    poll_interval_s: float = 0.5
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    # from `source` of each field, for `--show-config`: "cli", "env:NAME", "file", "default"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def secure(self) -> bool:
        if self.insecure is not None:
            return not self.insecure
        scheme = urllib.parse.urlsplit(self.resolved_endpoint()).scheme
        return scheme == "https"

    def resolved_endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint
        return DEFAULT_GRPC_ENDPOINT if self.protocol == "grpc" else DEFAULT_HTTP_ENDPOINT

    def traces_url(self) -> str:
        """The full HTTP URL for traces (HTTP/protobuf only)."""
        return _signal_url(self.resolved_endpoint(), "traces", self.sources.get("endpoint", ""))

    def metrics_url(self) -> str:
        if self.metrics_endpoint:
            return _signal_url(self.metrics_endpoint, "metrics", self.sources.get("metrics_endpoint", ""))
        return _signal_url(self.resolved_endpoint(), "metrics", "")

    def grpc_target(self) -> str:
        """host:port for a gRPC channel: the scheme only says whether TLS is used."""
        endpoint = self.resolved_endpoint()
        parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        if not parts.hostname or not parts.port:
            raise OtlpConfigError(f"gRPC endpoint {endpoint!r} needs a host and a port (e.g. host:4317)")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return f"{host}:{parts.port}"


def _signal_url(endpoint: str, signal: str, source: str) -> str:
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if source.removeprefix("env:") in _SIGNAL_ENDPOINT_ENV:
        return endpoint  # the spec: a signal-specific endpoint is used as is
    return endpoint.rstrip("/") + f"/v1/{signal}"


def parse_key_values(text: str, what: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (the W3C baggage-like form of OTEL_EXPORTER_OTLP_HEADERS), values URL-decoded."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise OtlpConfigError(f"bad {what} entry {item.strip()!r}: expected key=value")
        out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return out


def _parse_bool(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no", ""):
        return False
    raise OtlpConfigError(f"{name}={text!r} is not a boolean (true/false)")


def _coerce(key: str, value: object, origin: str) -> object:
    """Turn a string (env) or TOML value into the field's type, with one clear error line."""
    try:
        if key in ("headers", "resource_attributes"):
            if isinstance(value, Mapping):
                return {str(k): str(v) for k, v in value.items()}
            return parse_key_values(str(value), f"{origin} {key}")
        if key == "timeout_s" and origin.startswith("env:"):
            # The OTLP exporter spec gives OTEL_EXPORTER_OTLP_TIMEOUT in milliseconds.
            return float(value) / 1000.0
        if key in ("insecure",):
            return value if isinstance(value, bool) else _parse_bool(str(value), origin)
        default = OtlpConfig.__dataclass_fields__[key].default
        if isinstance(default, bool):
            return value if isinstance(value, bool) else _parse_bool(str(value), origin)
        if isinstance(default, float):
            return float(value)  # type: ignore[arg-type]
        if isinstance(default, int):
            return int(value)  # type: ignore[arg-type]
        return str(value)
    except ValueError as exc:
        raise OtlpConfigError(f"{origin} {key}={value!r}: {exc}") from None


def load_file(path: Path | str) -> dict[str, object]:
    """The [otlp] table of a TOML config file (the daemon's), or {} when it has none."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise OtlpConfigError(f"no config file at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise OtlpConfigError(f"{path} is not valid TOML: {exc}") from None
    table = data.get("otlp", {})
    if not isinstance(table, dict):
        raise OtlpConfigError(f"{path}: [otlp] must be a table")
    return table


def resolve(
    cli: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, object] | None = None,
) -> OtlpConfig:
    """Merge the layers: a key set on the command line wins, then the environment, then the file."""
    env = os.environ if env is None else env
    known = {f.name for f in fields(OtlpConfig)} - {"sources"}
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for key, value in (file_values or {}).items():
        if key not in known:
            raise OtlpConfigError(f"config file: unknown [otlp] key {key!r}")
        values[key], sources[key] = _coerce(key, value, "file"), "file"
    for key, names in ENV.items():
        for name in names:
            if env.get(name, "").strip():
                values[key], sources[key] = _coerce(key, env[name], f"env:{name}"), f"env:{name}"
                break
    for key, value in (cli or {}).items():
        if value is None:
            continue
        if key not in known:
            raise OtlpConfigError(f"unknown OTLP option {key!r}")
        values[key], sources[key] = _coerce(key, value, "cli") if isinstance(value, str) else value, "cli"
    config = replace(OtlpConfig(), **values, sources=sources)
    return validate(config)


def validate(config: OtlpConfig) -> OtlpConfig:
    if config.protocol not in PROTOCOLS:
        raise OtlpConfigError(f"protocol {config.protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if config.compression not in ("none", "gzip"):
        raise OtlpConfigError(f"compression {config.compression!r} is not one of none, gzip")
    if config.trace_id_mode not in ("prompt", "random"):
        raise OtlpConfigError(f"trace id mode {config.trace_id_mode!r} is not one of prompt, random")
    if config.timeout_s <= 0 or config.batch_spans <= 0 or config.backoff_initial_s <= 0:
        raise OtlpConfigError("timeout, batch size and backoff must be positive")
    if config.settle_s < 0 or config.rollup_wait_s < 0:
        raise OtlpConfigError("settle_s and rollup_wait_s must not be negative")
    if config.max_request_bytes < MIN_MAX_REQUEST_BYTES:
        raise OtlpConfigError(
            f"max_request_bytes {config.max_request_bytes} is below the minimum {MIN_MAX_REQUEST_BYTES}"
        )
    if config.sample_n < 1:
        raise OtlpConfigError("the sampling ratio N (of 1/N) must be at least 1")
    if config.backoff_max_s < config.backoff_initial_s:
        raise OtlpConfigError("the maximum backoff must be at least the initial backoff")
    if bool(config.client_key) != bool(config.client_certificate):
        raise OtlpConfigError("mTLS needs both a client key and a client certificate")
    for path in (config.certificate, config.client_key, config.client_certificate):
        if path and not Path(path).is_file():
            raise OtlpConfigError(f"no such file: {path}")
    if config.protocol == "grpc":
        config.grpc_target()  # raises on a malformed endpoint
    else:
        scheme = urllib.parse.urlsplit(config.traces_url()).scheme
        if scheme not in ("http", "https"):
            raise OtlpConfigError(
                f"HTTP endpoint {config.traces_url()!r} must start with http:// or https://"
            )
    return config
