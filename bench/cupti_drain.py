"""What the CUPTI drain thread costs per record, on this CPU: decoding cupti-python-shaped records
(llmobs.cupti.decode) and writing them to a real map's CUPTI ring (ShmWriter.publish_cupti).

The drain thread holds the GIL while it works, so this is the time it takes from the workload while a
trace runs. Printed side by side, interleaved over rounds by bench/harness.py (this machine is noisy):
the per-record writer call (ShmWriter.publish_cupti) against the batch ring write the drain thread uses
(ring.CuptiRing, with the clock mapping on columns), the decoder alone, and decode + batch write,
as microseconds per record and as a ratio to the per-record call.
The records mimic one launch: EXTERNAL_CORRELATION + runtime API + driver API + kernel.

    .venv/bin/python -m bench.cupti_drain [--launches 5000] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
from types import SimpleNamespace as R

from llmobs import clock
from llmobs.cupti import protocol as p
from llmobs.cupti.decode import ActivityDecoder
from llmobs.cupti.ring import CuptiRing
from llmobs.shm import layout
from llmobs.shm.writer import ShmWriter

from bench.harness import Arm, Report, add_json_option


def launches(n: int, step: int = 1) -> list:
    out = []
    for c in range(1, n + 1):
        t = 1_000_000 + c * 5000
        out += [
            R(kind=p.KIND_EXTERNAL_CORRELATION, external_kind=p.EXTERNAL_KIND_CUSTOM2, correlation_id=c,
              external_id=step),
            R(kind=p.KIND_RUNTIME, cbid=211, start=t, end=t + 500, correlation_id=c),
            R(kind=p.KIND_DRIVER, cbid=307, start=t + 100, end=t + 400, correlation_id=c),
            R(kind=p.KIND_CONCURRENT_KERNEL, name=f"kernel_{c % 40}", start=t + 1000, end=t + 3000,
              correlation_id=c, device_id=0, stream_id=7),
        ]  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("cupti_drain", args)
    with tempfile.TemporaryDirectory() as d:
        w = ShmWriter(shm_dir=d, cupti_capacity=1 << 16)
        acts = launches(args.launches)
        written = 3 * args.launches  # the external correlation records are consumed, not written
        ring = CuptiRing(w)
        fit = clock.ClockFit(ref_mono_ns=10**18, offset_ns=-(10**17), drift_ppm=3.0, residual_ns=10.0,
                             max_residual_ns=20.0, samples=32)  # fmt: skip

        def decoder():
            return ActivityDecoder(lambda s: w.name(layout.NAME_OTHER, s), None, lambda k, c: f"api_{k}_{c}")

        ready = decoder().decode(acts, final=True)

        def timed(work):
            def arm(ctx) -> dict[str, float]:
                with ctx.timed() as watch:
                    work()
                return {"us/record": watch.wall / written * 1e6, "k records/s": written / watch.wall / 1e3}

            return arm

        def per_record() -> None:
            for rec in ready:
                w.publish_cupti(*rec)

        arms = [
            Arm("per-record call", timed(per_record)),
            Arm("batch ring write", timed(lambda: ring.publish(ready, fit))),
            Arm("decode only", timed(lambda: decoder().decode(acts, final=True))),
            Arm("decode + batch", timed(lambda: ring.publish(decoder().decode(acts, final=True), fit))),
        ]
        report.compare(f"{args.launches} launches = {written} ring records per round", arms, args.rounds,
                                      metrics=["us/record", "k records/s"])  # fmt: skip
        w.close()
    report.finish()


if __name__ == "__main__":
    main()
