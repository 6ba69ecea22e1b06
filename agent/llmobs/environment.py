"""Every environment variable llmobs reads, one documented constant each (the one place that names them).

In the style of opentelemetry-python's `sdk/environment_variables`: a constant whose value is its own
name, and a docstring saying what it does, its default and who reads it. Nothing else in the project
reads `os.environ` by a literal `LLMOBS_*` name (tests/unit/test_environment.py greps for it), and
docs/environment.md lists every constant (the same test checks the table against these docstrings).

The workload imports this module (the shm writer reads LLMOBS_SHM_DIR at its first step), so it must stay
import-light: constants only, no imports at all.

The daemon's settings (docs/daemon.md) each have a variable here; their value is parsed and validated by
the setting, with the precedence flag > variable > config file > default (llmobs.settings). The
standard OpenTelemetry variables are read through llmobs.otlp.config (docs/otlp.md); the one the
workload itself reads is named here too.
"""

# ---- the workload (import llmobs) --------------------------------------------------------------------
LLMOBS_SHM_DIR = "LLMOBS_SHM_DIR"
"""The directory the workload creates its shared-memory map in (llmobs.<pid>).

Default: /dev/shm. Read by: the workload's shm writer (llmobs/shm/writer.py), at its first step.
"""

LLMOBS_STEPS_CAPACITY = "LLMOBS_STEPS_CAPACITY"
"""Token-step records in the map's step ring; a slower agent loses the oldest beyond this (counted).

Default: 32768. Read by: the workload's shm writer (llmobs/shm/writer.py), at its first step.
"""

LLMOBS_THREAD_CTX_LIB = "LLMOBS_THREAD_CTX_LIB"
"""The OTEP 4947 thread-context library (exports otel_thread_ctx_v1); a path that does not load turns
the thread context off.

Default: agent/llmobs/shm/c/libllmobs_otel_thread_ctx.so (built by `pip install`, setup.py). Read by:
llmobs/shm/thread_ctx.py (the workload), at its first token step.
"""

# ---- every agent command ------------------------------------------------------------------------------
LLMOBS_DB = "LLMOBS_DB"
"""The DuckDB store; `--db PATH` overrides it; the daemon's store.path.

Default: /var/lib/llmobs/llmobs.duckdb. Read by: store/sink.py (the --db default of attach, query,
export, otlp, explain, demo) and the daemon's settings.
"""

LLMOBS_DUCKDB_MEMORY_LIMIT = "LLMOBS_DUCKDB_MEMORY_LIMIT"
"""DuckDB's memory limit (a DuckDB size, e.g. 128MB) for a store the agent writes; it spills beyond.

Default: 32MB. Read by: store/sink.py (attach, demo, run).
"""

LLMOBS_STORE_MAX_HOLD_S = "LLMOBS_STORE_MAX_HOLD_S"
"""Seconds the store writer may hold a small commit (fewer than 4,096 rows) while more rows come, so that
a slowly stepping target does not pay a commit's fixed cost every second: it can only shorten the hold
(a value that is not a number from 0 to 4 is ignored), never below the writer's 1 s commit delay. The
tests that kill an agent mid-run set it to 1 so that the commit they wait for comes within a second.

Default: 4. Read by: store/writer.py (attach, demo, run), when a pipeline's writer starts.
"""

LLMOBS_RUN_DIR = "LLMOBS_RUN_DIR"
"""Where live snapshots (attach.PID.json) and the daemon's status file are written; the daemon's
daemon.run_dir.

Default: /run/llmobs. Read by: pipeline/live.py (attach writes, top reads) and the daemon's settings.
"""

LLMOBS_CACHE_DIR = "LLMOBS_CACHE_DIR"
"""A writable directory for the probe-cost calibration's private executable file (tried first).

Default: /run/llmobs, then $TMPDIR. Read by: bpf/calibrate.py (attach and run, when the governor is on).
"""

LLMOBS_BPF_CACHE_DIR = "LLMOBS_BPF_CACHE_DIR"
"""Where compiled BPF programs are cached (one file per source, kernel and bcc version), so an attach
after the first does not compile; a private directory (0700, ours), created when missing.

Default: /var/cache/llmobs/bpf as root, else ~/.cache/llmobs/bpf. Read by: bpf/cache.py (attach, run, demo).
"""

LLMOBS_BPF_DIR = "LLMOBS_BPF_DIR"
"""The directory holding the BPF C sources (llmobs_events.h, NAME.bpf.c), instead of the packaged ones.

Default: llmobs/bpf/c, shipped in the package. Read by: bpf/program.py, when a program is assembled.
"""

# ---- the daemon (`llmobs-agent run`): one per setting, docs/daemon.md has the allowed values -----------
LLMOBS_CONFIG = "LLMOBS_CONFIG"
"""The daemon's TOML config file when --config is not given.

Default: /etc/llmobs/llmobs-agent.toml if it exists. Read by: daemon/config.py.
"""

LLMOBS_RETENTION_AGE = "LLMOBS_RETENTION_AGE"
"""store.retention_age: rows older than this are deleted; 0 keeps everything.

Default: 7d. Read by: the daemon's settings.
"""

LLMOBS_RETENTION_BYTES = "LLMOBS_RETENTION_BYTES"
"""store.retention_bytes: the store is trimmed to this size at start; 0 for no limit.

Default: 0. Read by: the daemon's settings.
"""

LLMOBS_STORE_PROMPTS = "LLMOBS_STORE_PROMPTS"
"""store.store_prompts: keep raw prompt text (reserved: nothing captures it yet).

Default: false. Read by: the daemon's settings.
"""

LLMOBS_PROFILES = "LLMOBS_PROFILES"
"""probes.profiles: the probe profiles attached to every target.

Default: cpu,host. Read by: the daemon's settings.
"""

LLMOBS_SAMPLE_N = "LLMOBS_SAMPLE_N"
"""probes.sample_n: events leave the kernel 1 in N (totals stay exact).

Default: 1. Read by: the daemon's settings.
"""

LLMOBS_SAMPLE_MODE = "LLMOBS_SAMPLE_MODE"
"""probes.sample_mode: trace (keep a request whole) or cpu (per-CPU counter hash).

Default: trace. Read by: the daemon's settings.
"""

LLMOBS_THIN = "LLMOBS_THIN"
"""probes.thin: linear and page_fault_user ship 1 in N of a step's events (per-step counts stay exact).

Default: 64. Read by: the daemon's settings.
"""

LLMOBS_IOCTL_PATHS = "LLMOBS_IOCTL_PATHS"
"""probes.ioctl_paths: the device files whose ioctls the host profile times.

Default: /dev/nvidia*. Read by: the daemon's settings.
"""

LLMOBS_SELECT_USERS = "LLMOBS_SELECT_USERS"
"""select.users: attach only to processes of these users or uids (comma-separated).

Default: (empty). Read by: the daemon's settings.
"""

LLMOBS_SELECT_CGROUP = "LLMOBS_SELECT_CGROUP"
"""select.cgroup: attach only to processes in a cgroup matching this glob.

Default: (empty). Read by: the daemon's settings.
"""

LLMOBS_SELECT_COMMAND = "LLMOBS_SELECT_COMMAND"
"""select.command: attach only to processes whose command line matches this regular expression.

Default: (empty). Read by: the daemon's settings.
"""

LLMOBS_DISCOVERY_INTERVAL_S = "LLMOBS_DISCOVERY_INTERVAL_S"
"""discovery.interval_s: how often /proc is scanned for new and gone processes, in seconds.

Default: 2.0. Read by: the daemon's settings.
"""

LLMOBS_DISCOVERY_RECHECK_S = "LLMOBS_DISCOVERY_RECHECK_S"
"""discovery.recheck_s: a process that did not qualify is looked at again after this many seconds.

Default: 30.0. Read by: the daemon's settings.
"""

LLMOBS_OVERHEAD_BUDGET = "LLMOBS_OVERHEAD_BUDGET"
"""overhead.budget: the estimated slowdown, a fraction (0.01 = 1%), above which probes are shed; 0: off.

Default: 0.01. Read by: the daemon's settings.
"""

LLMOBS_OVERHEAD_COST_SCALE = "LLMOBS_OVERHEAD_COST_SCALE"
"""overhead.cost_scale: the starting value of each target's learned factor over the calibrated probe costs.

Default: 2.3. Read by: the daemon's settings.
"""

LLMOBS_CPU_PRIORITY = "LLMOBS_CPU_PRIORITY"
"""overhead.cpu_priority: idle (SCHED_IDLE: the agent runs only on CPU the workload leaves) or normal.

Default: idle. Read by: the daemon's settings and attach (llmobs/runtime/cpu_priority.py).
"""

LLMOBS_MAX_TARGETS = "LLMOBS_MAX_TARGETS"
"""daemon.max_targets: at most this many processes are attached at once.

Default: 64. Read by: the daemon's settings.
"""

LLMOBS_DETECTOR = "LLMOBS_DETECTOR"
"""detector.name: the token-loss anomaly detectors (calibrated, ttest, mad, both, all or off).

Default: calibrated. Read by: the daemon's settings.
"""

LLMOBS_ALARM_RATE = "LLMOBS_ALARM_RATE"
"""detector.alarm_rate: the calibrated detector's false alarms per clean token (e.g. 1e-4).

Default: 0.001. Read by: the daemon's settings.
"""

LLMOBS_DETECTOR_FDR = "LLMOBS_DETECTOR_FDR"
"""detector.fdr: the Benjamini-Hochberg level of the calibrated detector's request verdict.

Default: 0.01. Read by: the daemon's settings.
"""

LLMOBS_DETECTOR_WINDOW = "LLMOBS_DETECTOR_WINDOW"
"""detector.window: the preceding tokens of the request the t-test and MAD compare each loss with.

Default: 32. Read by: the daemon's settings.
"""

LLMOBS_DETECTOR_ALPHA = "LLMOBS_DETECTOR_ALPHA"
"""detector.alpha: the t-test's one-sided significance level.

Default: 0.01. Read by: the daemon's settings.
"""

LLMOBS_DETECTOR_MAD_THRESHOLD = "LLMOBS_DETECTOR_MAD_THRESHOLD"
"""detector.mad_threshold: the modified z-score above which the MAD detector flags a token.

Default: 3.5. Read by: the daemon's settings.
"""

LLMOBS_DETECTOR_AFTERMATH = "LLMOBS_DETECTOR_AFTERMATH"
"""detector.aftermath: the tokens after a calibrated flag that are taken as its consequence (untested)
unless their loss also stands out within their request; 0: none.

Default: 16. Read by: the daemon's settings.
"""

LLMOBS_REPLAY_ON_ANOMALY = "LLMOBS_REPLAY_ON_ANOMALY"
"""replay.on_anomaly: replay each flagged token in its workload's flight recorder and store the verdict.

Default: false. Read by: the daemon's settings.
"""

LLMOBS_REPLAY_MAX_PER_MINUTE = "LLMOBS_REPLAY_MAX_PER_MINUTE"
"""replay.max_per_minute: at most this many automatic replays per target in any minute.

Default: 2. Read by: the daemon's settings.
"""

# ---- scripts/gpu_check.sh (the GPU machine's check) ---------------------------------------------------
LLMOBS_USE_CARRY = "LLMOBS_USE_CARRY"
"""Non-empty: use the carried bcc and kernel headers even where the machine has its own.

Default: (empty). Read by: scripts/gpu_check.sh.
"""

LLMOBS_CARRY = "LLMOBS_CARRY"
"""The folder of carried wheels, bcc and headers.

Default: .gpucarry in the checkout. Read by: scripts/gpu_check.sh.
"""

LLMOBS_STAGE = "LLMOBS_STAGE"
"""The folder the check stages its venv and the package in.

Default: $TMPDIR/llmobs-gpu-stage. Read by: scripts/gpu_check.sh.
"""

LLMOBS_GPU_CHECK_TIMEOUT = "LLMOBS_GPU_CHECK_TIMEOUT"
"""Seconds after which the check stops and reports partial results.

Default: 290. Read by: scripts/gpu_check.sh.
"""

# ---- standard OpenTelemetry variables read outside llmobs.otlp.config ----------------------------------
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
"""The service.name of the workload's resource (and of the agent's exporter, via llmobs.otlp.config).

Default: unknown_service:<python executable>. Read by: shm/otel_ctx.py (the workload).
"""
