#!/usr/bin/env python3
"""What the CUPTI drain thread costs per record, on this CPU: decoding cupti-python-shaped records
(llmobs.cupti.decode) and writing them to a real map's CUPTI ring (ShmWriter.publish_cupti).

The drain thread holds the GIL while it works, so this is the time it takes from the workload while a
trace runs. Printed side by side, interleaved over rounds (this machine is noisy): the per-record
writer call (ShmWriter.publish_cupti) against the batch ring write the drain thread uses
(ring.CuptiRing, with the clock mapping on columns), the decoder alone, and decode + batch write,
as microseconds per record and as a ratio to the per-record call.
The records mimic one launch: EXTERNAL_CORRELATION + runtime API + driver API + kernel.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace as R

from llmobs import clock
from llmobs.cupti import protocol as p
from llmobs.cupti.decode import ActivityDecoder
from llmobs.cupti.ring import CuptiRing
from llmobs.shm import layout
from llmobs.shm.writer import ShmWriter


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
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--launches", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        w = ShmWriter(shm_dir=d, cupti_capacity=1 << 16)
        acts = launches(args.launches)
        written = 3 * args.launches  # the external correlation records are consumed, not written
        ring = CuptiRing(w)
        fit = clock.ClockFit(ref_mono_ns=10**18, offset_ns=-(10**17), drift_ppm=3.0, residual_ns=10.0,
                             max_residual_ns=20.0, samples=32)  # fmt: skip
        names = ("per-record call", "batch ring write", "decode only", "decode + batch")
        times: dict[str, list[float]] = {name: [] for name in names}

        def decoder():
            return ActivityDecoder(lambda s: w.name(layout.NAME_OTHER, s), None, lambda k, c: f"api_{k}_{c}")

        ready = decoder().decode(acts, final=True)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for rec in ready:
                w.publish_cupti(*rec)
            times["per-record call"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ring.publish(ready, fit)
            times["batch ring write"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decoder().decode(acts, final=True)
            times["decode only"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ring.publish(decoder().decode(acts, final=True), fit)
            times["decode + batch"].append(time.perf_counter() - t0)
        w.close()
    base = statistics.median(times["per-record call"])
    print(f"{args.launches} launches = {written} ring records per round, {args.rounds} rounds interleaved")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<17} {med / written * 1e6:7.2f} us/record  {written / med / 1e3:8.1f} k records/s"
              f"  x{med / base:5.2f} of the per-record call")  # fmt: skip


if __name__ == "__main__":
    main()
