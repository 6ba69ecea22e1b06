"""Issue 16: a known spike's incident row is committed while `attach --db` runs and the workload keeps
generating at full speed (scripts/workload.py --requests 0: until told to stop).

The agent side is `attach --db` in this process - the probes attached, the runtime's own loop
(llmobs.runtime.Agent) on a thread, the store opened as attach opens it - so the test can read the
store through a cursor of the agent's own database while the agent holds the file (DuckDB lets one
process open a file for writing). Synchronised without sleeps: the store is polled with a timeout
(bench.rotel_harness.wait_until). The latency itself is measured, not asserted: bench/anomaly_latency.py
--attach reports its p99 over >= 30 spikes.
"""

from __future__ import annotations

import threading

from llmobs.bpf.session import AttachSession, Options
from llmobs.pipeline import Pipeline
from llmobs.runtime.agent import Agent
from llmobs.store.sink import AGENT_THREADS, DuckDBStore, agent_memory_limit

from bench.held_workload import HeldWorkload
from bench.rotel_harness import wait_until

SPIKE, BATCH = 12, 2  # the least likely token at index 12 of every request, two prompts per request

_FIRST_SPIKE = """
SELECT incident_id, pid, scope, first_step, last_step, first_seq, last_seq, peak_step, tokens, detectors
FROM incidents WHERE pid = $pid AND first_step <= $spike AND last_step >= $spike ORDER BY first_seq, batch_row
LIMIT 1
"""


def test_a_known_spikes_incident_row_is_committed_while_the_workload_runs(tmp_path):
    db = tmp_path / "live.duckdb"
    args = ("--model", "tiny", "--requests", "0", "--batch", str(BATCH), "--max-new-tokens", "24",
            "--spike-steps", str(SPIKE))  # fmt: skip
    with HeldWorkload(*args) as workload:
        session = AttachSession(workload.pid, Options())
        session.start()
        store = DuckDBStore(db, memory_limit=agent_memory_limit(), threads=AGENT_THREADS)
        pipeline = Pipeline(store, workload.pid, session=session, snapshot=False)
        agent = Agent(store=store, owns_store=True, budget=0)
        agent.add(session, pipeline)
        stop = threading.Event()
        loop = threading.Thread(target=agent.run, args=(stop.is_set,), name="test-agent", daemon=True)
        conn = store.connection.cursor()  # the agent's database, read while it writes
        try:
            loop.start()
            workload._send(b"go\n")
            key = {"pid": workload.pid, "spike": SPIKE}
            found = wait_until(lambda: conn.execute(_FIRST_SPIKE, key).fetchall(), timeout=120,
                               what="the spike's incident row")  # fmt: skip
            assert workload.process.poll() is None  # committed while the workload still generates
            incident_id, pid, scope, first, last, first_seq, last_seq, peak, tokens, detectors = found[0]
            linked = conn.execute(
                "SELECT step, step_seq, detector FROM anomalies WHERE incident_id = ?"
                " ORDER BY step_seq, detector",
                [incident_id],
            ).fetchall()
            row = conn.execute(
                "SELECT batch_row FROM incidents WHERE incident_id = ?", [incident_id]
            ).fetchall()
            # the incident is exactly its linked rows: the spike (its peak) and any flag within the gap
            steps = sorted({r[0] for r in linked})
            assert (pid, scope, peak) == (workload.pid, "request", SPIKE) and SPIKE in steps
            assert (first, last, tokens) == (steps[0], steps[-1], len(steps))
            assert (first_seq, last_seq) == (linked[0][1], linked[-1][1])
            assert detectors == ",".join(sorted({r[2] for r in linked}))
            assert incident_id == f"{workload.pid}-{first_seq}-{row[0][0]}"
        finally:
            stop.set()
            loop.join(60)
            conn.close()
            workload.process.terminate()  # --requests 0 generates until SIGTERM
            agent.close("test done")
        assert not loop.is_alive()
    with DuckDBStore(db, read_only=True) as done:
        state = done.connection.execute(
            "SELECT state, count(*) FROM incidents WHERE pid = ? GROUP BY state", [workload.pid]
        ).fetchall()
    assert [s for s, _n in state] == ["closed"]  # detach closes every incident: closed ones are final
