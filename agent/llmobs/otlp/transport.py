"""Sending encoded OTLP requests: gRPC (grpcio) or HTTP/protobuf (requests). One try per call, no retry.

Why not opentelemetry-exporter-otlp's OTLPSpanExporter: it takes SDK span objects and encodes them
itself, while our spans come straight from store rows (encoder.py builds the protobuf); and it retries
inside `export()` on its own schedule, which would hide failures from the delivery loop that owns the
retry, the cursor and the counters. So we use the same libraries it uses (grpcio with the generated
service stubs from opentelemetry-proto; requests for HTTP) and keep one attempt per call here.

Each call returns a SendResult instead of raising: ok, whether a retry may succeed (the OTLP spec's
retryable gRPC codes / HTTP statuses), whether the collector refused the request for its size (then
the same bytes never succeed, however often retried: delivery sends it again in smaller pieces), the
collector's requested delay, and rejected items from a partial success.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
import requests
from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from llmobs.otlp.config import OtlpConfig

# The OTLP specification's retryable gRPC codes and HTTP statuses.
RETRYABLE_GRPC = frozenset(
    {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
RETRYABLE_HTTP = frozenset({429, 502, 503, 504})
# A request over the collector's size limit. gRPC has no code of its own for it: rotel (tonic) answers
# OUT_OF_RANGE "decoded message length too large", grpc-go servers (the OpenTelemetry Collector)
# RESOURCE_EXHAUSTED "received message larger than max", and the client's own check RESOURCE_EXHAUSTED
# "Sent message larger than max". Both codes are retryable per the spec (RESOURCE_EXHAUSTED is also
# throttling), so the size is told by the wording. HTTP: 413 Content Too Large.
TOO_LARGE_GRPC = frozenset({grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED})
TOO_LARGE_DETAIL = re.compile(r"too (large|big)|larger than (the )?max", re.IGNORECASE)
TOO_LARGE_HTTP = 413
USER_AGENT = "llmobs-agent-otlp/0.1.0"


@dataclass(frozen=True)
class SendResult:
    ok: bool
    retryable: bool = False
    error: str | None = None
    retry_after_s: float | None = None
    rejected: int = 0  # items the collector refused in a partial success (not retryable)
    too_large: bool = False  # refused for its size: smaller requests may pass, the same one never


class Transport:
    """send_traces / send_metrics take a protobuf request and return a SendResult."""

    def send_traces(self, request: trace_service_pb2.ExportTraceServiceRequest) -> SendResult:
        raise NotImplementedError

    def send_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> SendResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


class GrpcTransport(Transport):
    def __init__(self, config: OtlpConfig):
        self.timeout_s = config.timeout_s
        self.metadata = tuple((k.lower(), v) for k, v in config.headers.items())
        # Reconnect quickly once the collector is back: gRPC's default reconnect backoff grows to 120 s,
        # which would hold exports long after a restarted collector listens again.
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(config.backoff_max_s * 1000)),
            ("grpc.primary_user_agent", USER_AGENT),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
        compression = (
            grpc.Compression.Gzip if config.compression == "gzip" else grpc.Compression.NoCompression
        )
        target = config.grpc_target()
        if config.secure:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(config.certificate),
                private_key=_read(config.client_key),
                certificate_chain=_read(config.client_certificate),
            )
            self.channel = grpc.secure_channel(target, credentials, options=options, compression=compression)
        else:
            self.channel = grpc.insecure_channel(target, options=options, compression=compression)
        # Not the generated stub's Export: its serializer takes only the message class, and the encoder
        # hands an already-serialised request (encoder.EncodedTraces); both have SerializeToString.
        self._export_traces = self.channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=_serialize,
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
        self._metrics = metrics_service_pb2_grpc.MetricsServiceStub(self.channel)

    def _call(self, method, request: Message, rejected_field: str) -> SendResult:
        try:
            response = method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            too_large = code in TOO_LARGE_GRPC and bool(TOO_LARGE_DETAIL.search(detail or ""))
            return SendResult(
                ok=False,
                retryable=code in RETRYABLE_GRPC and not too_large,
                error=f"gRPC {code.name if code else 'error'}: {detail}",
                retry_after_s=_grpc_retry_delay(exc),
                too_large=too_large,
            )
        partial = response.partial_success
        rejected = int(getattr(partial, rejected_field, 0))
        return SendResult(ok=True, rejected=rejected, error=partial.error_message or None)

    def send_traces(self, request):
        return self._call(self._export_traces, request, "rejected_spans")

    def send_metrics(self, request):
        return self._call(self._metrics.Export, request, "rejected_data_points")

    def close(self) -> None:
        self.channel.close()


def _serialize(request) -> bytes:
    return request.SerializeToString()


def _grpc_retry_delay(exc: grpc.RpcError) -> float | None:
    """The delay a collector asked for in google.rpc.RetryInfo (trailing metadata), if any."""
    try:
        from google.rpc.error_details_pb2 import RetryInfo

        for key, value in exc.trailing_metadata() or ():
            if key == "google.rpc.retryinfo-bin":
                info = RetryInfo()
                info.ParseFromString(value)
                return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    except Exception:  # no metadata on a local failure, or an unparsable one: use our own backoff
        return None
    return None


class HttpTransport(Transport):
    def __init__(self, config: OtlpConfig):
        self.timeout_s = config.timeout_s
        self.traces_url = config.traces_url()
        self.metrics_url = config.metrics_url()
        self.gzip = config.compression == "gzip"
        self.session = requests.Session()
        self.session.headers.update({"Content-Type": "application/x-protobuf", "User-Agent": USER_AGENT})
        if self.gzip:
            self.session.headers["Content-Encoding"] = "gzip"
        self.session.headers.update(config.headers)
        # Passed on every request, not set on the session: requests lets REQUESTS_CA_BUNDLE /
        # CURL_CA_BUNDLE override a session's `verify`, which would silently drop --certificate.
        self.verify: bool | str = True
        if config.certificate:
            self.verify = config.certificate
        elif config.insecure and self.traces_url.startswith("https://"):
            self.verify = False  # insecure=true over https: the user asked to skip verification
        self.cert = (config.client_certificate, config.client_key) if config.client_certificate else None

    def _post(self, url: str, request: Message, response_type, rejected_field: str) -> SendResult:
        body = request.SerializeToString()
        if self.gzip:
            body = gzip.compress(body, compresslevel=5)
        try:
            response = self.session.post(
                url, data=body, timeout=self.timeout_s, verify=self.verify, cert=self.cert
            )
        except requests.RequestException as exc:  # refused, reset, timed out: the collector may come back
            return SendResult(
                ok=False, retryable=True, error=f"HTTP {type(exc).__name__}: {_first_line(exc)}"
            )
        if 200 <= response.status_code < 300:
            rejected, message = 0, None
            if response.content:
                try:
                    parsed = response_type.FromString(response.content)
                    rejected = int(getattr(parsed.partial_success, rejected_field, 0))
                    message = parsed.partial_success.error_message or None
                except Exception:
                    message = "unparsable response body"
            return SendResult(ok=True, rejected=rejected, error=message)
        return SendResult(
            ok=False,
            retryable=response.status_code in RETRYABLE_HTTP,
            error=f"HTTP {response.status_code}: {response.text[:200].strip()}",
            retry_after_s=_retry_after(response.headers.get("Retry-After")),
            too_large=response.status_code == TOO_LARGE_HTTP,
        )

    def send_traces(self, request):
        return self._post(
            self.traces_url, request, trace_service_pb2.ExportTraceServiceResponse, "rejected_spans"
        )

    def send_metrics(self, request):
        return self._post(
            self.metrics_url,
            request,
            metrics_service_pb2.ExportMetricsServiceResponse,
            "rejected_data_points",
        )

    def close(self) -> None:
        self.session.close()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        return None  # an HTTP date: rare from collectors; fall back to our own backoff


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def make_transport(config: OtlpConfig) -> Transport:
    return GrpcTransport(config) if config.protocol == "grpc" else HttpTransport(config)
