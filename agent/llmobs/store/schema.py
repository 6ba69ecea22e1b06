"""The store's schema as an ordered list of migrations, applied at open inside one transaction each.

Rule (also in docs/store-schema.md): a migration is never edited once released; a change is a new
migration appended to MIGRATIONS with the next version number. `schema_migrations` records which ran.
A store written by an older agent is upgraded in order when a newer agent opens it; a store newer than
this agent is refused (it could hold columns this code would silently drop).

Column types follow what the ingest path hands DuckDB so that appends need no casts (measured: casts and
strings dominate the append cost): int32 pids, int64 ns, uint64 trace-id words in the event tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from llmobs.errors import StoreError

# Columns of the three eBPF event tables, in the order of records.md. The 128-bit trace id is kept as two
# uint64 words (the ring's own form): a 32-char string per event halves the append rate, and the
# `trace_hex(hi, lo)` macro gives the agreed hex form when a query wants it.
_EVENT_COLUMNS = """
    pid INTEGER NOT NULL,
    tid INTEGER,
    cpu SMALLINT,
    ts_ns BIGINT NOT NULL,
    probe VARCHAR NOT NULL,
    step_seq BIGINT NOT NULL DEFAULT 0,
    trace_hi UBIGINT NOT NULL DEFAULT 0,
    trace_lo UBIGINT NOT NULL DEFAULT 0,
    value BIGINT NOT NULL DEFAULT 0,
    duration_ns BIGINT NOT NULL DEFAULT 0,
    sample_ratio INTEGER NOT NULL DEFAULT 1"""


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "core tables: processes, requests, token_steps, events, probe_aggregates, step_rollups, anomalies",
        (
            """CREATE TABLE processes (
                pid INTEGER NOT NULL,
                start_ns BIGINT NOT NULL DEFAULT 0,
                exe VARCHAR,
                cmdline VARCHAR,
                map_path VARCHAR,
                abi_version INTEGER,
                first_seen_ns BIGINT,
                last_seen_ns BIGINT,
                exit_ns BIGINT,
                PRIMARY KEY (pid, start_ns))""",
            # A request is (pid, trace_id, first_step_seq): the trace id alone is not unique, since the
            # workload derives it from the prompt (a repeated prompt repeats it); first_step_seq is
            # step_seq - step, the forward pass of the request's first token.
            """CREATE TABLE requests (
                pid INTEGER NOT NULL,
                trace_id VARCHAR NOT NULL,
                first_step_seq BIGINT NOT NULL,
                tenant VARCHAR,
                session VARCHAR,
                model_id VARCHAR,
                t_start_ns BIGINT,
                t_end_ns BIGINT,
                tokens BIGINT,
                mean_loss DOUBLE,
                PRIMARY KEY (pid, trace_id, first_step_seq))""",
            """CREATE TABLE token_steps (
                pid INTEGER NOT NULL,
                step_seq BIGINT NOT NULL,
                trace_id VARCHAR NOT NULL,
                step INTEGER,
                position INTEGER,
                token_id INTEGER,
                target_id INTEGER,
                loss FLOAT,
                entropy FLOAT,
                target_prob FLOAT,
                target_rank INTEGER,
                top1_prob FLOAT,
                latency_ns BIGINT,
                t_start_ns BIGINT NOT NULL,
                t_end_ns BIGINT NOT NULL,
                batch_row INTEGER,
                tenant VARCHAR,
                session VARCHAR,
                model_id VARCHAR,
                kv_len INTEGER)""",
            f"CREATE TABLE mem_events ({_EVENT_COLUMNS})",
            f"""CREATE TABLE host_events ({_EVENT_COLUMNS},
                kind VARCHAR NOT NULL DEFAULT 'host')""",
            f"""CREATE TABLE gpu_ops ({_EVENT_COLUMNS},
                source VARCHAR NOT NULL DEFAULT 'ebpf',
                name VARCHAR,
                correlation_id BIGINT,
                external_id BIGINT,
                device_id INTEGER,
                stream_id BIGINT,
                gpu_start_ns BIGINT,
                gpu_end_ns BIGINT)""",
            """CREATE TABLE probe_aggregates (
                pid INTEGER NOT NULL,
                step_seq BIGINT NOT NULL,
                probe VARCHAR NOT NULL,
                count BIGINT NOT NULL,
                sum_value BIGINT NOT NULL DEFAULT 0,
                sum_duration_ns BIGINT NOT NULL DEFAULT 0,
                ts_ns BIGINT)""",
            """CREATE TABLE step_rollups (
                pid INTEGER NOT NULL,
                step_seq BIGINT NOT NULL,
                tokens INTEGER NOT NULL,
                t_start_ns BIGINT NOT NULL,
                t_end_ns BIGINT NOT NULL,
                decode_latency_ns BIGINT,
                launches BIGINT NOT NULL,
                allocations BIGINT NOT NULL,
                alloc_bytes BIGINT NOT NULL,
                frees BIGINT NOT NULL,
                memcpy_bytes BIGINT NOT NULL,
                off_cpu_ns BIGINT NOT NULL,
                page_faults BIGINT NOT NULL,
                compute_calls BIGINT NOT NULL,
                gpu_ns BIGINT,
                tagged_events BIGINT NOT NULL,
                windowed_events BIGINT NOT NULL,
                counts_exact BOOLEAN NOT NULL,
                PRIMARY KEY (pid, step_seq))""",
            """CREATE TABLE anomalies (
                ts_ns BIGINT NOT NULL,
                pid INTEGER,
                step_seq BIGINT,
                trace_id VARCHAR,
                kind VARCHAR NOT NULL,
                score DOUBLE,
                detail VARCHAR)""",
            # The agreed hex form of a trace id ('' when untracked) from the two stored words.
            """CREATE MACRO trace_hex(hi, lo) AS
                CASE WHEN hi = 0 AND lo = 0 THEN '' ELSE printf('%016x%016x', hi, lo) END""",
            # Which class of work a probe counts as, for rollups; by name because exact aggregates
            # carry no kind. Launch before alloc: 'cuLaunchKernel' must not match '%alloc%'.
            """CREATE MACRO probe_class(probe) AS CASE
                WHEN probe ILIKE '%launch%' THEN 'launch'
                WHEN probe ILIKE '%free%' THEN 'free'
                WHEN probe ILIKE '%alloc%' THEN 'alloc'
                WHEN probe ILIKE '%memcpy%' THEN 'memcpy'
                WHEN probe ILIKE '%sched_switch%' OR probe ILIKE '%off_cpu%' OR probe ILIKE '%offcpu%'
                    THEN 'offcpu'
                WHEN probe ILIKE '%fault%' THEN 'fault'
                WHEN probe ILIKE '%gemm%' OR probe ILIKE '%linear%' OR probe ILIKE '%::mm%' THEN 'compute'
                ELSE 'other' END""",
        ),
    ),
    Migration(
        2,
        "clock_fits: every clock conversion the agent used, with its measured error",
        (
            """CREATE TABLE clock_fits (
                ts_ns BIGINT NOT NULL,
                pid INTEGER NOT NULL DEFAULT 0,
                clock VARCHAR NOT NULL,
                ref_mono_ns BIGINT NOT NULL,
                offset_ns BIGINT NOT NULL,
                drift_ppm DOUBLE NOT NULL DEFAULT 0,
                error_ns DOUBLE NOT NULL,
                residual_ns DOUBLE NOT NULL,
                samples INTEGER NOT NULL)""",
        ),
    ),
    Migration(
        3,
        "layer_streams: per-layer metrics of sampled token steps (attention entropy), from map ABI v2",
        (
            # One row per (step, batch row, layer, head); head -1 = mean over heads; kind 1 = attention
            # entropy (nats). ts_ns is when the agent read the record (CLOCK_MONOTONIC), for retention;
            # the step's own times are in token_steps (join on pid, step_seq, batch_row).
            """CREATE TABLE layer_streams (
                pid INTEGER NOT NULL,
                step_seq BIGINT NOT NULL,
                trace_id VARCHAR NOT NULL,
                batch_row INTEGER NOT NULL,
                layer INTEGER NOT NULL,
                head INTEGER NOT NULL,
                kind INTEGER NOT NULL,
                value FLOAT,
                ts_ns BIGINT NOT NULL)""",
        ),
    ),
    Migration(
        4,
        "anomalies: request key, token index, detector, evidence JSON, artifact path",
        (
            # Columns added for issue 9 (diag-detect). `artifact` (nullable VARCHAR) is the path of a
            # file that illustrates the anomaly, e.g. diag-layers' dL/dE heatmap PNG: the agent sets it
            # with UPDATE anomalies SET artifact = ? WHERE pid = ? AND step_seq = ? [AND kind = ?].
            # `evidence` is the JSON the evidence pass (llmobs.diagnostics.evidence) fills in once the
            # step is rolled up; NULL until then. A request is (pid, trace_id, first_step_seq).
            "ALTER TABLE anomalies ADD COLUMN first_step_seq BIGINT",
            "ALTER TABLE anomalies ADD COLUMN step INTEGER",
            "ALTER TABLE anomalies ADD COLUMN batch_row INTEGER",
            "ALTER TABLE anomalies ADD COLUMN detector VARCHAR",
            "ALTER TABLE anomalies ADD COLUMN evidence VARCHAR",
            "ALTER TABLE anomalies ADD COLUMN evidence_ns BIGINT",
            "ALTER TABLE anomalies ADD COLUMN artifact VARCHAR",
        ),
    ),
    Migration(
        5,
        "layer_modules: the qualified module name behind each (pid, layer-stream kind, layer)",
        (
            # diag-layers: the workload registers each layer stream's module name once (map names ring,
            # `module:<kind>:<layer>:<name>`, llmobs.shm.names); root cause names the module from
            # here. ts_ns is when the agent first read the name (retention).
            """CREATE TABLE layer_modules (
                pid INTEGER NOT NULL,
                kind INTEGER NOT NULL,
                layer INTEGER NOT NULL,
                module VARCHAR NOT NULL,
                ts_ns BIGINT NOT NULL)""",
        ),
    ),
    Migration(
        6,
        "gpu_samples: NVML utilisation and memory per (sample time, pid, GPU); step_gpu joins them to steps",
        (
            # One row per NVML sample of a tracked process on one GPU (llmobs.gpu.nvml_source), about
            # once a second. ts_ns is when the agent read it (CLOCK_MONOTONIC, like every other table).
            # The process's own numbers (sm_util, mem_util: percent of NVML's last sample period; mem_used
            # bytes) are NULL where NVML has none yet; gpu_* and device_* are the whole device's.
            """CREATE TABLE gpu_samples (
                ts_ns BIGINT NOT NULL,
                pid INTEGER NOT NULL,
                gpu_index INTEGER NOT NULL,
                gpu_uuid VARCHAR,
                gpu_name VARCHAR,
                sm_util SMALLINT,
                mem_util SMALLINT,
                mem_used BIGINT,
                gpu_util SMALLINT,
                gpu_mem_util SMALLINT,
                device_mem_used BIGINT,
                device_mem_total BIGINT)""",
            # Each token step with, per GPU its process was sampled on, the nearest sample taken at or
            # before the step's end and at most 1.5 s before it (samples come once a second; a decode
            # step is a few ms, so "a sample inside the step" would leave almost every step without one).
            # Steps with no such sample are absent: LEFT JOIN it from token_steps to keep them.
            """CREATE VIEW step_gpu AS
                WITH gpus AS (SELECT DISTINCT pid, gpu_index FROM gpu_samples)
                SELECT t.pid, t.step_seq, t.batch_row, t.trace_id, t.t_start_ns, t.t_end_ns,
                    g.gpu_index, g.gpu_uuid, g.ts_ns AS sample_ns, g.sm_util, g.mem_util, g.mem_used,
                    g.gpu_util, g.gpu_mem_util, g.device_mem_used, g.device_mem_total
                FROM token_steps t JOIN gpus ON t.pid = gpus.pid
                ASOF JOIN gpu_samples g
                    ON g.pid = t.pid AND g.gpu_index = gpus.gpu_index AND g.ts_ns <= t.t_end_ns
                WHERE t.t_end_ns - g.ts_ns <= 1500000000""",
        ),
    ),
    Migration(
        7,
        "token_steps.ingest_seq: a per-store sequence number assigned at append (the OTLP export cursor)",
        (
            # Monotonic per store in commit order (appends are serialised by the store's lock): the OTLP
            # exporter reads "ingest_seq > its position" instead of sorting token_steps by time each batch,
            # and DuckDB skips the row groups below the position by their min/max. Rows already in the
            # store are numbered in their stored (append) order. The sequence survives compaction (COPY
            # FROM DATABASE carries its value).
            "CREATE SEQUENCE token_steps_ingest_seq START 1",
            "ALTER TABLE token_steps ADD COLUMN ingest_seq BIGINT DEFAULT nextval('token_steps_ingest_seq')",
        ),
    ),
    Migration(
        8,
        "mixed-batch rows (token_steps.tokens_in_pass, request_seq, request_id), request_events; map ABI v3",
        (
            # A forward pass of a continuously batching server carries rows of many requests: each token
            # step says how many tokens its row processed in that pass (1 for a decode, the prompt or its
            # last chunk for a request's first token; 0 = unknown, e.g. a v2 map) - the weights by which a
            # pass's totals are apportioned to its rows - and which request it belongs to: request_seq,
            # the workload's number of the request (0 = none), and request_id, the engine's id ('' = none).
            "ALTER TABLE token_steps ADD COLUMN tokens_in_pass INTEGER DEFAULT 0",
            "ALTER TABLE token_steps ADD COLUMN request_seq BIGINT DEFAULT 0",
            "ALTER TABLE token_steps ADD COLUMN request_id VARCHAR DEFAULT ''",
            # The map's request-events ring (docs/shm-abi.md, v3). kind 'end': one row per served request
            # that finished, failed or was cancelled, with its figures (queue_ns = first scheduled -
            # arrival, ttft_ns = first token - arrival, tpot_ns = (last token - first token) /
            # (decoded - 1); -1 where the request never got there), finish_reason stop | length |
            # cancelled | error. kind 'chunk': a prefill chunk that produced no token, a row of pass
            # step_seq that has no token step (prefill_tokens = its tokens, position = its first one), so
            # the rows of a pass are its token steps plus its chunks.
            """CREATE TABLE request_events (
                pid INTEGER NOT NULL,
                kind VARCHAR NOT NULL,
                request_seq BIGINT NOT NULL,
                request_id VARCHAR,
                step_seq BIGINT,
                trace_id VARCHAR,
                tenant VARCHAR,
                session VARCHAR,
                model_id VARCHAR,
                t_start_ns BIGINT,
                t_scheduled_ns BIGINT,
                t_first_token_ns BIGINT,
                t_last_token_ns BIGINT,
                t_end_ns BIGINT NOT NULL,
                queue_ns BIGINT,
                ttft_ns BIGINT,
                tpot_ns BIGINT,
                prompt_tokens INTEGER,
                prefill_tokens INTEGER,
                decoded_tokens INTEGER,
                kv_blocks INTEGER,
                prefix_hit_tokens INTEGER,
                finish_reason VARCHAR,
                position INTEGER)""",
        ),
    ),
    Migration(
        9,
        "pass_shares: each pass's totals apportioned to its rows by tokens; requests keyed by request_seq",
        (
            # One row per row of a forward pass - a token step (row_kind 'step') or a prefill chunk
            # without a token ('chunk', from request_events) - with its share of the pass's exact
            # step_rollups totals, by the tokens the row processed in the pass (docs/store-schema.md,
            # "pass_shares": the rule). Integer columns add up exactly per pass (largest remainder).
            # t_start_ns is the pass's (its step_rollups row's), so correlate re-shares exactly the
            # passes it re-rolls. No primary key: a teacher-forced pass has many token steps per
            # batch row; join token_steps on (pid, step_seq, batch_row, position).
            """CREATE TABLE pass_shares (
                pid INTEGER NOT NULL,
                step_seq BIGINT NOT NULL,
                t_start_ns BIGINT NOT NULL,
                row_kind VARCHAR NOT NULL,
                batch_row INTEGER,
                step INTEGER,
                position INTEGER,
                request_seq BIGINT NOT NULL DEFAULT 0,
                trace_id VARCHAR,
                tenant VARCHAR,
                session VARCHAR,
                tokens INTEGER NOT NULL,
                weight BIGINT NOT NULL,
                compute_ns BIGINT NOT NULL,
                off_cpu_ns BIGINT NOT NULL,
                allocations BIGINT NOT NULL,
                alloc_bytes BIGINT NOT NULL,
                compute_calls BIGINT NOT NULL,
                launches BIGINT NOT NULL,
                gpu_ns BIGINT)""",
            # A served request is (pid, request_seq): its tokens come from passes it does not all take
            # part in, so step_seq - step is not constant. The key gains request_seq (0 for generate()
            # requests, which keep first_step_seq = step_seq - step): add-copy-drop, as the rule says.
            """CREATE TABLE requests_v10 (
                pid INTEGER NOT NULL,
                trace_id VARCHAR NOT NULL,
                first_step_seq BIGINT NOT NULL,
                tenant VARCHAR,
                session VARCHAR,
                model_id VARCHAR,
                t_start_ns BIGINT,
                t_end_ns BIGINT,
                tokens BIGINT,
                mean_loss DOUBLE,
                request_seq BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (pid, trace_id, first_step_seq, request_seq))""",
            "INSERT INTO requests_v10 SELECT *, 0 FROM requests",
            "DROP TABLE requests",
            "ALTER TABLE requests_v10 RENAME TO requests",
        ),
    ),
    Migration(
        10,
        "request_events: the caller's trace (trace_from_caller, parent_span_id, trace_flags, prompt_hash)",
        (
            # A request that arrived with a W3C traceparent carries its caller's trace id (trace_id, and
            # the trace id of its token steps): trace_from_caller, the caller's span id (parent_span_id, 16
            # hex; '' when the trace id is llmobs' own), its trace-flags, and prompt_hash, the prompt-hash
            # trace id it would have had (= trace_id without a caller), so identical prompts still group.
            "ALTER TABLE request_events ADD COLUMN trace_from_caller BOOLEAN DEFAULT false",
            "ALTER TABLE request_events ADD COLUMN parent_span_id VARCHAR DEFAULT ''",
            "ALTER TABLE request_events ADD COLUMN trace_flags INTEGER DEFAULT 0",
            "ALTER TABLE request_events ADD COLUMN prompt_hash VARCHAR DEFAULT ''",
        ),
    ),
    Migration(
        11,
        "incidents: flagged tokens merged (llmobs.diagnostics.incidents); anomalies.incident_id links them",
        (
            # One row per incident: the anomaly rows of one request within GAP_PASSES passes of each
            # other (scope 'request'), or consecutive flagged teacher-forced/training passes of a process
            # (scope 'pass'). Written by the anomaly lane after its rows: at its close, or once open
            # for 2 s (then updated as it grows); a closed one is final. seq
            # columns are step_seq (forward passes), step columns token indices within the request.
            """CREATE TABLE incidents (
                incident_id VARCHAR PRIMARY KEY,
                pid INTEGER NOT NULL,
                scope VARCHAR NOT NULL,
                trace_id VARCHAR,
                first_step_seq BIGINT,
                batch_row INTEGER,
                first_seq BIGINT NOT NULL,
                last_seq BIGINT NOT NULL,
                first_step INTEGER,
                last_step INTEGER,
                t_first_ns BIGINT,
                t_last_ns BIGINT,
                peak_score DOUBLE,
                peak_seq BIGINT,
                peak_step INTEGER,
                peak_kind VARCHAR,
                detectors VARCHAR,
                tokens INTEGER NOT NULL,
                rows INTEGER NOT NULL,
                state VARCHAR NOT NULL,
                ts_ns BIGINT NOT NULL,
                updated_ns BIGINT NOT NULL,
                closed_ns BIGINT,
                artifact VARCHAR)""",
            "ALTER TABLE anomalies ADD COLUMN incident_id VARCHAR",
        ),
    ),
    Migration(
        12,
        "replays: flight-recorder replays of a token step's window (verdict, per pass, layer, head, ops)",
        (
            # One row per replay (llmobs.pipeline.replay_ingest; the verdict from llmobs.diagnostics.replay).
            # The target is a token step: (pid, target_step_seq, target_batch_row), which is token `step`
            # of the request (pid, trace_id, first_step_seq). replay_id is '<pid>-<target_step_seq>-
            # <target_batch_row>-<ack_step_seq>' (the command's ack names the file it wrote). ts_ns is when
            # the agent ingested it (CLOCK_MONOTONIC, retention); t_start_ns/t_end_ns the replay's own run.
            """CREATE TABLE replays (
                replay_id VARCHAR PRIMARY KEY,
                pid INTEGER NOT NULL,
                trace_id VARCHAR,
                first_step_seq BIGINT,
                target_step_seq BIGINT NOT NULL,
                target_batch_row INTEGER NOT NULL,
                step INTEGER,
                window_steps INTEGER,
                status VARCHAR NOT NULL,
                reason VARCHAR,
                source VARCHAR,
                snapshot_len INTEGER,
                snapshot_dropped BOOLEAN,
                model VARCHAR,
                layers INTEGER,
                heads INTEGER,
                repeats INTEGER,
                live_batch_size INTEGER,
                verdict VARCHAR,
                verdict_detail VARCHAR,
                first_diverging_layer INTEGER,
                cause VARCHAR,
                recorded_loss FLOAT,
                replay_loss FLOAT,
                loss_diff FLOAT,
                op_hash UBIGINT,
                op_graph_hash UBIGINT,
                linear_calls INTEGER,
                live_linear_calls BIGINT,
                root_layer INTEGER,
                root_head INTEGER,
                root_z DOUBLE,
                wall_ms DOUBLE,
                prefill_ms DOUBLE,
                t_start_ns BIGINT,
                t_end_ns BIGINT,
                trigger VARCHAR,
                meta VARCHAR,
                ts_ns BIGINT NOT NULL)""",
            # One row per replayed pass and repeat: token step `step` of the request, scored by the pass
            # whose newest position is `position`; top5 as lists, best first.
            """CREATE TABLE replay_steps (
                replay_id VARCHAR NOT NULL,
                repeat SMALLINT NOT NULL,
                pass INTEGER NOT NULL,
                step INTEGER,
                position INTEGER NOT NULL,
                step_seq BIGINT,
                loss FLOAT,
                entropy FLOAT,
                recorded_loss FLOAT,
                top5_ids BIGINT[],
                top5_probs FLOAT[],
                op_hash UBIGINT,
                graph_hash UBIGINT,
                linear_calls INTEGER,
                ts_ns BIGINT NOT NULL)""",
            # Per pass, repeat, layer and head: the newest query's attention entropy (nats, NaN where the
            # model gave none); the layer's MLP output variance and output fingerprint repeat on each of
            # its heads' rows (head -1 when the model has no heads to report). maxdiff: max |repeat 0 -
            # repeat 1| of the layer output (repeat 0 rows only).
            """CREATE TABLE replay_layers (
                replay_id VARCHAR NOT NULL,
                repeat SMALLINT NOT NULL,
                pass INTEGER NOT NULL,
                step INTEGER,
                layer SMALLINT NOT NULL,
                head SMALLINT NOT NULL,
                attn_entropy FLOAT,
                mlp_var FLOAT,
                fingerprint UBIGINT,
                maxdiff FLOAT,
                ts_ns BIGINT NOT NULL)""",
            # The operator sequence of repeat 0's first replayed pass, one op per row in call order.
            """CREATE TABLE replay_ops (
                replay_id VARCHAR NOT NULL,
                seq INTEGER NOT NULL,
                op VARCHAR NOT NULL,
                ts_ns BIGINT NOT NULL)""",
        ),
    ),
    Migration(
        13,
        "compare: request labels (variant, user labels), model factors, prompt intent; shadow token steps",
        (
            # One row per label of a request (llmobs.context(variant=..., labels={...}); key 'variant' is
            # the variant). A request is (pid, request_seq): a request with labels always has a
            # request_seq. trace_id is the request's (so labels pair across processes and stores).
            """CREATE TABLE request_labels (
                pid INTEGER NOT NULL,
                request_seq BIGINT NOT NULL,
                trace_id VARCHAR,
                key VARCHAR NOT NULL,
                value VARCHAR NOT NULL,
                ts_ns BIGINT NOT NULL,
                PRIMARY KEY (pid, request_seq, key))""",
            # Factors the publisher reads from the model itself (adapters, dtype, quantization,
            # tokenizer, vocab size), one row per (model, key).
            """CREATE TABLE model_factors (
                pid INTEGER NOT NULL,
                model_id VARCHAR NOT NULL,
                key VARCHAR NOT NULL,
                value VARCHAR NOT NULL,
                ts_ns BIGINT NOT NULL,
                PRIMARY KEY (pid, model_id, key))""",
            # The prompt's intent fingerprint (opt-in; derived in the workload, never the text): a
            # template id (variable parts masked), a 64-bit SimHash and a MinHash signature (hex) of
            # its word n-grams, and the structured slots (ids from the documented vocabulary).
            """CREATE TABLE request_intents (
                pid INTEGER NOT NULL,
                request_seq BIGINT NOT NULL,
                trace_id VARCHAR,
                template_id VARCHAR NOT NULL,
                simhash UBIGINT NOT NULL,
                minhash VARCHAR NOT NULL,
                action VARCHAR NOT NULL,
                output_format VARCHAR NOT NULL,
                constraints VARCHAR NOT NULL,
                ts_ns BIGINT NOT NULL,
                PRIMARY KEY (pid, request_seq))""",
            # A shadow model's teacher-forced score of a primary request's tokens (llmobs.shadow): same
            # trace_id, step and position as the primary's token step, its own request_seq and variant.
            "ALTER TABLE token_steps ADD COLUMN shadow BOOLEAN DEFAULT false",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version

# Tables whose rows age out, and the column that says how old a row is.
TIME_COLUMN: dict[str, str] = {
    "token_steps": "t_start_ns",
    "mem_events": "ts_ns",
    "host_events": "ts_ns",
    "gpu_ops": "ts_ns",
    "probe_aggregates": "ts_ns",
    "step_rollups": "t_start_ns",
    "requests": "t_end_ns",
    "anomalies": "ts_ns",
    "incidents": "ts_ns",
    "clock_fits": "ts_ns",
    "layer_streams": "ts_ns",
    "layer_modules": "ts_ns",
    "gpu_samples": "ts_ns",
    "request_events": "t_end_ns",
    "pass_shares": "t_start_ns",
    "replays": "ts_ns",
    "replay_steps": "ts_ns",
    "replay_layers": "ts_ns",
    "replay_ops": "ts_ns",
    "request_labels": "ts_ns",
    "model_factors": "ts_ns",
    "request_intents": "ts_ns",
    "processes": "last_seen_ns",
}

EVENT_TABLES = ("mem_events", "gpu_ops", "host_events")
# Where an eBPF event of each `kind` is stored.
TABLE_FOR_KIND = {"mem": "mem_events", "gpu": "gpu_ops", "host": "host_events", "compute": "host_events"}


def current_version(conn: duckdb.DuckDBPyConnection) -> int:
    exists = conn.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_migrations'"
    ).fetchall()[0][0]
    if not exists:
        return 0
    return conn.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchall()[0][0]


def migrate(conn: duckdb.DuckDBPyConnection, target: int = LATEST_VERSION) -> list[int]:
    """Apply every migration above the store's version up to `target`; return the versions applied."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR,"
        " applied_at TIMESTAMP DEFAULT current_timestamp)"
    )
    version = current_version(conn)
    if version > LATEST_VERSION:
        raise StoreError(
            f"the store is at schema version {version}, newer than this agent's {LATEST_VERSION}",
            hint="upgrade llmobs-agent, or point --db at another file",
        )
    applied = []
    for migration in MIGRATIONS:
        if version < migration.version <= target:
            conn.execute("BEGIN TRANSACTION")
            try:
                for statement in migration.statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, description) VALUES (?, ?)",
                    [migration.version, migration.description],
                )
                conn.execute("COMMIT")
            except Exception:
                conn.execute("ROLLBACK")
                raise
            applied.append(migration.version)
    return applied


def tables_columns(conn: duckdb.DuckDBPyConnection, tables) -> dict[str, dict[str, str]]:
    """table_columns of several tables in one query (each information_schema query costs ~3 ms here,
    and a store opens with two dozen tables: 75 ms on the path to attach's first event)."""
    wanted = list(tables)
    rows = conn.execute(
        "SELECT table_name, column_name, data_type FROM information_schema.columns"
        " WHERE table_name IN (SELECT unnest($tables)) ORDER BY table_name, ordinal_position",
        {"tables": wanted},
    ).fetchall()
    out: dict[str, dict[str, str]] = {table: {} for table in wanted}
    for table, column, data_type in rows:
        out[table][column] = data_type
    return out


def table_columns(conn: duckdb.DuckDBPyConnection, table: str) -> dict[str, str]:
    """name -> DuckDB type of a table's columns, in order."""
    rows = conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ?"
        " ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return dict(rows)


def probe_class(probe: str) -> str:
    """The probe_class macro above (migration 1) in Python, for the same columns without a database
    (`top` and the report classify probes without a store at hand)."""
    name = probe.lower()
    for needle, cls in (("launch", "launch"), ("free", "free"), ("alloc", "alloc"), ("memcpy", "memcpy")):
        if needle in name:
            return cls
    if "sched_switch" in name or "off_cpu" in name or "offcpu" in name:
        return "offcpu"
    if "fault" in name:
        return "fault"
    if "gemm" in name or "linear" in name or "::mm" in name:
        return "compute"
    return "other"
