"""What one discovery scan costs the daemon on this host: a cold scan (every process examined, maps of
the selected ones read) against a steady-state scan (one `stat` per pid, nothing examined), measured
interleaved in one run by bench/harness.py, printed as times and their ratio.

    .venv/bin/python -m bench.discovery [--rounds 20] [--json PATH]

A cold scan is what a fresh ProcWatcher does; a steady scan is every later one while no process
starts. Selectors are empty (every process qualifies on its libraries): the costliest case.
"""

from __future__ import annotations

import argparse

from llmobs.daemon.discovery import ProcWatcher, Selectors

from bench.harness import Arm, Report, add_json_option


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    add_json_option(parser)
    args = parser.parse_args()
    report = Report("discovery", args)
    steady = ProcWatcher(Selectors(), recheck_s=3600.0, young_s=0.0)
    steady.scan()

    def cold_scan(ctx) -> dict[str, float]:
        cold = ProcWatcher(Selectors(), recheck_s=3600.0, young_s=0.0)
        with ctx.timed() as watch:
            cold.scan()
        return {"ms": watch.wall * 1e3, "maps files read": cold.stats.maps_read}

    def steady_scan(ctx) -> dict[str, float]:
        before = steady.stats.maps_read
        with ctx.timed() as watch:
            steady.scan()
        assert steady.stats.maps_read - before <= 2, "a steady scan re-read maps"
        return {"ms": watch.wall * 1e3, "maps files read": steady.stats.maps_read - before}

    report.note(
        f"host: {len(steady.pids())} processes; {len(steady.tracked)} qualify (map or libtorch/libcuda)"
    )
    made = report.compare("discovery scan", [Arm("steady", steady_scan), Arm("cold", cold_scan)], args.rounds,
                          metrics=["ms", "maps files read"])  # fmt: skip
    steady_ms = made.median("steady", "ms")
    report.note(f"at the default 2 s interval a steady scan costs {steady_ms / 2000 * 100:.3f}% of one core")
    report.finish()


if __name__ == "__main__":
    main()
