"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for screenshots of web UIs.

The protocol runs over `--remote-debugging-pipe` (NUL-terminated JSON on fds 3 and 4), so no port is
opened and no websocket library is needed. A page is loaded, then `wait_for` polls a JavaScript condition
(the UI has rendered what the picture is about) with a timeout, never a fixed sleep; `click_text` clicks
an element by its visible text; `screenshot` writes a PNG.

`prefix` runs Chromium inside another command (`nsenter ...`: the network namespace of the server it
looks at, bench/phoenix_harness.py). Used by scripts/docs_pictures.py.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.rotel_harness import wait_until


class Chromium:
    def __init__(self, width: int = 1600, height: int = 1000, prefix: list[str] | None = None):
        binary = shutil.which("chromium")
        if binary is None:
            raise FileNotFoundError("chromium is not installed (apt-get install chromium; scripts/setup.sh)")
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="llmobs-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        command = [
            *(prefix or []), binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            "--remote-debugging-pipe", f"--user-data-dir={self._profile.name}",
            f"--window-size={width},{height}", "about:blank",
        ]  # fmt: skip

        def fds_3_and_4():  # Chromium reads commands on fd 3 and answers on fd 4
            high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)  # out of the way of 3 and 4 first
            high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=fds_3_and_4,
            # not close_fds: that would close 3 and 4 after fds_3_and_4; Python's own fds are
            # non-inheritable (PEP 446), so nothing else reaches Chromium
            close_fds=False,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self._session = attached["sessionId"]
        self.call("Page.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    # --- the protocol -------------------------------------------------------------------------
    def _call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:  # answers and events interleave; skip events until our answer comes
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def call(self, method: str, params: dict | None = None) -> dict:
        return self._call(method, params, self._session)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    # --- what the pictures need --------------------------------------------------------------
    def open(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def wait_for(self, condition: str, timeout: float = 60.0, what: str = "") -> None:
        """Poll the JavaScript `condition` until it is truthy."""
        wait_until(lambda: self.evaluate(f"Boolean({condition})"), timeout, 0.2, what or condition)

    def text_present(self, text: str) -> str:
        return f"document.body && document.body.innerText.includes({json.dumps(text)})"

    def click_text(self, text: str, selector: str = "*") -> None:
        """Click the innermost element matching `selector` whose visible text is exactly `text`."""
        clicked = self.evaluate(
            f"""(() => {{
              const hits = [...document.querySelectorAll({json.dumps(selector)})]
                .filter(e => e.innerText && e.innerText.trim() === {json.dumps(text)});
              const el = hits[hits.length - 1];
              if (!el) return false;
              el.scrollIntoView({{block: "center"}});
              el.dispatchEvent(new MouseEvent("mousedown", {{bubbles: true}}));
              el.dispatchEvent(new MouseEvent("mouseup", {{bubbles: true}}));
              el.click();
              return true;
            }})()"""
        )
        if not clicked:
            raise RuntimeError(f"nothing with the text {text!r} to click")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):  # already gone: nothing to close
            self._call("Browser.close")
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
