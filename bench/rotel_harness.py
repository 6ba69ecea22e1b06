"""A real `rotel-agent` OTLP collector on free 127.0.0.1 ports, and a parser for its debug log.

Started with `--exporter blackhole --debug-log traces --debug-log metrics --debug-log-verbosity detailed`:
it prints every span (ids, parent, name, attributes, events) and metric it receives on stdout, which goes
to a log file we parse. Readiness is polled (a TCP connect on both ports, bounded), never slept for.
Shared by the tests (tests/e2e, tests/bpf) and the benchmarks (bench/otlp.py, bench/runtime.py).

Note: rotel acknowledges a request before it logs it, so a SIGKILLed rotel can lose spans it already
acked; `stop()` sends SIGTERM, on which rotel drains what it accepted.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import rotel


def rotel_binary() -> Path:
    return Path(rotel.__file__).parent / "rotel-agent"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or `timeout` passes (then raise TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def stop_process(process: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM a server we started and wait for its exit; SIGKILL it if it hangs (no-op when gone)."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_process(process)


def kill_process(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)


class Rotel:
    """One rotel-agent process; `restart()` keeps the ports and starts a new log file."""

    def __init__(self, workdir: Path, grpc_port: int | None = None, http_port: int | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.logs: list[Path] = []
        self.process: subprocess.Popen | None = None

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 20.0) -> Rotel:
        log_path = self.workdir / f"rotel-{len(self.logs)}.log"
        self.logs.append(log_path)
        command = [
            str(rotel_binary()), "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--exporter", "blackhole",
            "--debug-log", "traces", "--debug-log", "metrics",
            "--debug-log-verbosity", "detailed",
            "--pid-file", str(self.workdir / "rotel.pid"),
        ]  # fmt: skip
        with open(log_path, "ab") as log:  # append mode: a reader may truncate it (bench)
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            wait_until(
                lambda: self._exited() or (_port_open(self.grpc_port) and _port_open(self.http_port)),
                timeout,
                what=f"rotel on 127.0.0.1:{self.grpc_port}/{self.http_port}",
            )
        except TimeoutError:
            self.kill()
            raise
        if self._exited():
            raise RuntimeError(f"rotel exited with {self.process.returncode}: {log_path.read_text()[-2000:]}")
        return self

    def _exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (rotel drains what it accepted) and wait for the exit; SIGKILL if it hangs."""
        stop_process(self.process, timeout)

    def kill(self) -> None:
        kill_process(self.process)

    def restart(self) -> Rotel:
        self.stop()
        return self.start()

    def text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def spans(self) -> list[ParsedSpan]:
        return parse_spans(self.text())

    def span_count(self) -> int:
        return self.text().count("\nSpan #")

    def wait_for_spans(self, span_ids: set[str], timeout: float, what: str = "spans") -> list[ParsedSpan]:
        """Wait until every id of `span_ids` is in the log; return the parsed spans.

        Polls the cheap line count and parses the log only once it holds enough spans: parsing a log of
        thousands of spans every 20 ms holds the GIL long enough to starve an exporter thread of the
        same process (the test then times out waiting for spans the exporter has no time to send)."""

        def arrived() -> list[ParsedSpan] | None:
            if self.span_count() < len(span_ids):
                return None
            spans = self.spans()
            return spans if {s.span_id for s in spans} >= span_ids else None

        return wait_until(arrived, timeout, interval=0.1, what=what)

    def __enter__(self) -> Rotel:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class ParsedSpan:
    trace_id: str
    span_id: str = ""
    parent_id: str = ""
    name: str = ""
    attributes: dict[str, object] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    resource: dict[str, object] = field(default_factory=dict)


_ATTR = re.compile(r"^\s*-> ([^:]+): (Str|Int|Double|Bool)\((.*)\)\s*$")
_FIELD = re.compile(r"^\s+(Trace ID|Parent ID|ID|Name)\s+: ?(.*)$")


def _value(kind: str, text: str) -> object:
    if kind == "Int":
        return int(text)
    if kind == "Double":
        return float(text)
    if kind == "Bool":
        return text == "true"
    return text


def parse_spans(text: str) -> list[ParsedSpan]:
    """Spans from rotel's detailed debug log (its text format, one field per line)."""
    spans: list[ParsedSpan] = []
    resource: dict[str, object] = {}
    section = None  # "resource" | "span" | "attributes" | "events"
    span: ParsedSpan | None = None
    event: dict | None = None
    for line in text.splitlines():
        if line.startswith("ResourceSpans #") or line.startswith("ResourceMetrics #"):
            resource, section, span = {}, "resource-header", None
            continue
        if line.startswith("Resource attributes:"):
            section = "resource"
            continue
        if line.startswith("ScopeSpans #") or line.startswith("ScopeMetrics #"):
            section = None
            continue
        if line.startswith("Span #"):
            span = ParsedSpan(trace_id="", resource=resource)
            spans.append(span)
            section = "span"
            continue
        if line.startswith("Attributes:") and span is not None:
            section = "attributes"
            continue
        if line.startswith("Events:") and span is not None:
            section = "events"
            continue
        if line.startswith("SpanEvent #") and span is not None:
            event = {"attributes": {}}
            span.events.append(event)
            continue
        if line.startswith("Links:") or line.startswith("Metric #"):
            section, span = None, None
            continue
        match = _FIELD.match(line)
        if match and section == "span" and span is not None:
            key, value = match.group(1), match.group(2).strip()
            attr = {"Trace ID": "trace_id", "Parent ID": "parent_id", "ID": "span_id", "Name": "name"}[key]
            setattr(span, attr, value)
            continue
        match = _ATTR.match(line)
        if not match:
            if section == "events" and event is not None and line.strip().startswith("-> Name:"):
                event["name"] = line.split("-> Name:", 1)[1].strip()
            continue
        key, kind, raw = match.group(1).strip(), match.group(2), match.group(3)
        if section == "resource":
            resource[key] = _value(kind, raw)
        elif section == "attributes" and span is not None:
            span.attributes[key] = _value(kind, raw)
        elif section == "events" and event is not None:
            event["attributes"][key] = _value(kind, raw)
    return spans


POINT_VALUE = "@value"  # the key of a sum or gauge point's value in its parse_metrics dict


def parse_metrics(text: str) -> dict[str, dict]:
    """name -> {"points": [data point attribute dicts], "exemplars": [(trace_id, span_id)], "unit": str}
    from the metric part of rotel's detailed debug log (the last report of each name wins). A sum or
    gauge point's dict also holds its value under POINT_VALUE."""
    metrics: dict[str, dict] = {}
    current: dict | None = None
    section = None
    exemplar: dict | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("Metric #"):
            current, section = {"points": [], "exemplars": [], "unit": ""}, "descriptor"
            continue
        if current is None:
            continue
        if line.startswith("ResourceSpans #") or line.startswith("ResourceMetrics #"):
            current = None
            continue
        if section == "descriptor" and stripped.startswith("-> Name:"):
            metrics[stripped.split(":", 1)[1].strip()] = current
        elif section == "descriptor" and stripped.startswith("-> Unit:"):
            current["unit"] = stripped.split(":", 1)[1].strip()
        elif "DataPoints #" in line:
            current["points"].append({})
            section = "point"
        elif line.startswith("Data point attributes:"):
            section = "point-attributes"
        elif line.startswith("Exemplar #"):
            exemplar = {}
            section = "exemplar"
        elif line.startswith("Value: ") and section in ("point", "point-attributes") and current["points"]:
            current["points"][-1][POINT_VALUE] = float(line.split(":", 1)[1])  # a number point's value
            section = "point-value"
        elif section == "point-attributes" and (match := _ATTR.match(line)):
            current["points"][-1][match.group(1).strip()] = _value(match.group(2), match.group(3))
        elif section == "exemplar" and exemplar is not None and stripped.startswith("-> "):
            key, _, value = stripped[3:].partition(":")
            exemplar[key.strip()] = value.strip()
            if "Trace ID" in exemplar and "Span ID" in exemplar:
                current["exemplars"].append((exemplar["Trace ID"], exemplar["Span ID"]))
                exemplar = None
    return metrics
