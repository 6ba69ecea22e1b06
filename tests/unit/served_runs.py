"""A continuously batching server seen over several agent runs, for the unfinished-request tests (unit and
e2e): a real ServingPublisher writes a real map, a real ShmReader decodes what is new since the last run,
and it is appended to a real DuckDB store, as an attach that detached and a later one would."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from llmobs.publisher import request as publisher
from llmobs.publisher.serving import Row, ServingPublisher
from llmobs.shm.reader import ShmReader
from llmobs.shm.writer import ShmWriter
from llmobs.store.sink import DuckDBStore


class ServedRuns:
    """Requests arrive, take part in passes, finish; `ingest(store)` appends what the map holds that
    the store does not yet (the steps and request events since the previous call)."""

    def __init__(self, shm_dir, model: str = "tiny-llama"):
        Path(shm_dir).mkdir(parents=True, exist_ok=True)
        self.shm_dir = str(shm_dir)
        self.writer = ShmWriter(shm_dir=self.shm_dir, names_capacity=64, steps_capacity=256,
                                requests_capacity=32)  # fmt: skip
        self.pub = ServingPublisher(model, writer=self.writer)
        self.prompts: dict[str, list[int]] = {}
        self.generated: dict[str, int] = {}
        self._cursors = (0, 0)

    def arrive(self, rid: str, prompt: list[int], tenant: str, traceparent: str | None = None) -> None:
        with publisher.context(tenant=tenant, traceparent=traceparent):
            self.pub.request_arrived(rid, prompt)
        self.prompts[rid], self.generated[rid] = list(prompt), 0

    def step(self, rids: list[str]) -> None:
        """One forward pass with a row of each of `rids`: a whole prompt's prefill or one decode each."""
        rows = []
        for rid in rids:
            n, prompt = self.generated[rid], self.prompts[rid]
            rows.append(Row(rid, len(prompt) if n == 0 else 1, 0 if n == 0 else len(prompt) + n - 1, True))
        p = self.pub.pass_begin(rows)
        self.pub.pass_logits(torch.randn(len(rows), 32))
        self.pub.pass_end(p, [3] * len(rows))
        for rid in rids:
            self.generated[rid] += 1

    def finish(self, rid: str, reason: str = "length") -> None:
        self.pub.request_finished(rid, reason)

    def ingest(self, store: DuckDBStore) -> int:
        """Append the steps and request events written since the last call; the steps appended."""
        with ShmReader(os.getpid(), shm_dir=self.shm_dir) as reader:
            steps = reader.read_steps(self._cursors[0])
            events = reader.read_request_events(self._cursors[1])
        self._cursors = (steps.next_cursor, events.next_cursor)
        tables = {}
        if len(steps):
            tables["token_steps"] = steps.columns
        if len(events):
            tables["request_events"] = events.columns
        if tables:
            store.append(tables)
        return len(steps)

    def close(self) -> None:
        self.writer.close()
