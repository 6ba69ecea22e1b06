"""TLS and headers, for both protocols, against real TLS servers on 127.0.0.1 (rotel's receivers speak
plaintext only): a gRPC TraceService and an HTTPS /v1/traces endpoint, certificates made by openssl
for this test. Checks the collector is verified with the given CA, headers and gzip arrive, and an
unverifiable collector is refused without marking anything exported."""

from __future__ import annotations

import gzip
import http.server
import shutil
import ssl
import subprocess
import threading
from concurrent import futures

import grpc
import pytest
from llmobs.otlp.config import resolve
from llmobs.otlp.delivery import ExportFailed, OtlpExporter
from llmobs.otlp.source import ExportCursor
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.rotel_harness import free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A throwaway CA and a server certificate for IP 127.0.0.1 signed by it."""
    d = tmp_path_factory.mktemp("certs")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=llmobs-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return d


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps = synthetic.token_steps(99, 2, 5, batch_rows=1, start_ns=1_000_000_000_000)
    store.append({"token_steps": steps})
    yield store
    store.close()


class Recorder(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self):
        self.spans = 0
        self.metadata: list[dict] = []

    def Export(self, request, context):  # noqa: N802 (the generated service's method name)
        self.metadata.append(dict(context.invocation_metadata()))
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture
def grpc_tls(certs):
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(recorder, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(recorder, server)
    credentials = grpc.ssl_server_credentials(
        [((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())]
    )
    port = server.add_secure_port(f"127.0.0.1:{free_port()}", credentials)
    server.start()
    yield recorder, port
    server.stop(grace=None)


def config(**values):
    base = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
    return resolve({**base, **values}, env={})


def test_grpc_over_tls_verifies_with_the_given_ca_and_sends_headers(store, certs, grpc_tls):
    recorder, port = grpc_tls
    cfg = config(endpoint=f"https://127.0.0.1:{port}", certificate=str(certs / "ca.pem"),
                 headers={"Authorization": "Bearer t0ken", "X-Scope-OrgID": "team-a"})  # fmt: skip
    assert cfg.secure
    counters = OtlpExporter(store.connection.cursor(), cfg).run(give_up_after_s=20)
    assert counters.spans_sent == recorder.spans == 10 + 2
    assert recorder.metadata[0]["authorization"] == "Bearer t0ken"
    assert recorder.metadata[0]["x-scope-orgid"] == "team-a"


def test_grpc_collector_with_an_unknown_ca_is_refused_and_rows_kept(store, grpc_tls):
    _, port = grpc_tls
    exporter = OtlpExporter(store.connection.cursor(), config(endpoint=f"https://127.0.0.1:{port}"))
    with pytest.raises(ExportFailed, match="not exported"):
        exporter.run(give_up_after_s=0.5)
    assert exporter.counters.attempts_failed >= 1 and exporter.counters.spans_sent == 0
    assert ExportCursor(store.connection).pending_steps() == 10


@pytest.fixture
def https_server(certs):
    received: list[tuple[str, dict, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, dict(self.headers), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.pem", certs / "server.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], received
    server.shutdown()
    server.server_close()


def test_http_over_tls_with_gzip_and_headers(store, certs, https_server):
    port, received = https_server
    cfg = config(endpoint=f"https://127.0.0.1:{port}", protocol="http/protobuf", compression="gzip",
                 certificate=str(certs / "ca.pem"), headers={"authorization": "Basic abc"})  # fmt: skip
    counters = OtlpExporter(store.connection.cursor(), cfg).run(give_up_after_s=20)
    assert counters.spans_sent == 12
    traces = [r for r in received if r[0] == "/v1/traces"]
    assert traces and {r[0] for r in received} <= {"/v1/traces", "/v1/metrics"}
    path, headers, body = traces[0]
    assert headers["Content-Encoding"] == "gzip" and headers["authorization"] == "Basic abc"
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(gzip.decompress(body))
    assert sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans) == 12


def test_http_without_the_ca_is_refused(store, https_server):
    port, received = https_server
    cfg = config(endpoint=f"https://127.0.0.1:{port}", protocol="http/protobuf")
    exporter = OtlpExporter(store.connection.cursor(), cfg)
    with pytest.raises(ExportFailed):
        exporter.run(give_up_after_s=0.5)
    assert not received and "SSLError" in (exporter.counters.last_error or "")
