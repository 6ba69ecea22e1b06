"""A real Arize Phoenix server (OTLP over gRPC and HTTP, REST API, web UI) in a network namespace of its own.

Phoenix's gRPC collector binds `[::]` (hard-coded in phoenix/server/grpc_server.py; PHOENIX_HOST moves the
HTTP server only), so it runs in a fresh network namespace in which only `lo` is up: no other interface of
this machine, and nothing outside it, can reach it. Whatever talks to it joins that namespace through
`nsenter` (`Phoenix.inside(command)`): the exporter CLI, the REST queries, Chromium for the screenshots.
As root the namespace is a plain `unshare --net`; otherwise a user namespace maps us to root in it.

Readiness is polled (both ports answer, /healthz is 200), never slept for. Shared by
tests/e2e/test_otlp_phoenix.py and scripts/docs_pictures.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path

from bench.rotel_harness import kill_process, stop_process, wait_until

HTTP_PORT = 6006  # fixed: the namespace is new, so nothing else listens there
GRPC_PORT = 4317

# One request inside the namespace: GET a URL, print the body (non-2xx: exit 1 with the status).
_GET = """
import sys, urllib.request, urllib.error
try:
    sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
except urllib.error.HTTPError as exc:
    sys.exit(f"HTTP {exc.code}: {exc.read()[:500]!r}")
"""
# Both ports accept a connection and /healthz answers 200.
_READY = f"""
import socket, sys, urllib.request
try:
    socket.create_connection(("127.0.0.1", {GRPC_PORT}), timeout=0.5).close()
    urllib.request.urlopen("http://127.0.0.1:{HTTP_PORT}/healthz", timeout=1).read()
except OSError:
    sys.exit(1)
"""


def namespace_prefix() -> list[str]:
    """The `unshare` command that gives a child a network namespace of its own."""
    if os.geteuid() == 0:
        return ["unshare", "--net"]
    return ["unshare", "--user", "--map-root-user", "--net"]


class Phoenix:
    """One `phoenix serve` in its own network namespace, its data (SQLite) under `workdir`."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "phoenix.log"
        self.process: subprocess.Popen | None = None

    grpc_endpoint = f"http://127.0.0.1:{GRPC_PORT}"
    http_endpoint = f"http://127.0.0.1:{HTTP_PORT}"

    def start(self, timeout: float = 240.0) -> Phoenix:
        env = {
            **os.environ,
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(HTTP_PORT),
            "PHOENIX_GRPC_PORT": str(GRPC_PORT),
            "PHOENIX_WORKING_DIR": str(self.workdir),
            "PHOENIX_TELEMETRY_ENABLED": "false",
            "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",  # no web fonts: the UI renders offline
            # no LLM assistant (it needs a provider key; its animated button also never lets a page settle)
            "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
        }
        # `ip link set lo up` first: a new namespace's loopback is down. `exec` keeps one pid for
        # the namespace and the server, so nsenter --target and SIGTERM reach Phoenix itself.
        script = 'ip link set lo up && exec "$0" -m phoenix.server.main serve'
        command = [*namespace_prefix(), "--", "sh", "-c", script, sys.executable]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        try:
            wait_until(lambda: self._exited() or self._ready(), timeout, interval=0.25, what="Phoenix ready")
        except BaseException:  # a timeout, or an interrupt: leave no server behind
            self.kill()
            raise
        if self._exited():
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"phoenix exited with {self.process.returncode}: {tail}")
        return self

    def _exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def _ready(self) -> bool:
        try:  # a loaded machine can take seconds just to start the probe: that is "not yet", not a failure
            return self.run_inside([sys.executable, "-c", _READY], timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def inside(self, command: list[str]) -> list[str]:
        """`command` prefixed to run in Phoenix's network namespace."""
        assert self.process is not None, "Phoenix is not started"
        joined = ["--net"] if os.geteuid() == 0 else ["--user", "--net", "--preserve-credentials"]
        return ["nsenter", f"--target={self.process.pid}", *joined, "--", *command]

    def run_inside(self, command: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.inside(command), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )

    def get(self, path: str) -> dict:
        """GET `path` of Phoenix's HTTP server (REST API: /v1/...), decoded JSON."""
        result = self.run_inside([sys.executable, "-c", _GET, self.http_endpoint + path], timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"GET {path}: {result.stderr.strip()[-1000:]}")
        return json.loads(result.stdout)

    def projects(self) -> dict[str, str]:
        """project name -> Phoenix's project id."""
        return {p["name"]: p["id"] for p in self.get("/v1/projects")["data"]}

    def spans(self, project: str) -> list[dict]:
        """Every span of `project` as the REST API gives it (context, parent_id, attributes, events)."""
        spans: list[dict] = []
        cursor, name = "", urllib.parse.quote(project, safe="")
        while True:
            page = self.get(f"/v1/projects/{name}/spans?limit=1000{cursor}")
            spans.extend(page["data"])
            if not page.get("next_cursor"):
                return spans
            cursor = "&cursor=" + urllib.parse.quote(page["next_cursor"], safe="")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (uvicorn shuts down cleanly) and wait for the exit; SIGKILL if it hangs."""
        stop_process(self.process, timeout)

    def kill(self) -> None:
        kill_process(self.process)

    def __enter__(self) -> Phoenix:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
