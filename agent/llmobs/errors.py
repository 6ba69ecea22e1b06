"""The typed errors the agent raises, each with the exit code and the one-line hint the CLI prints.

Modelled on psutil's small exception tree: callers catch the class they can handle; the CLI catches
LlmobsError and prints `error: <message>` plus `hint: <what to do>`, then exits with `exit_code`.
"""

from __future__ import annotations


class ExitCode:
    """Distinct exit codes, documented in the README; scripts may rely on them."""

    OK = 0
    FAILURE = 1  # an unexpected failure (a bug): the traceback is printed
    USAGE = 2  # bad command-line arguments (argparse uses 2 as well)
    NO_SUCH_PROCESS = 3
    ACCESS_DENIED = 4  # not root / missing CAP_BPF, CAP_PERFMON, or the map is not ours to read
    MALFORMED_MAP = 5
    MISSING_LIBRARY = 6  # bcc, a CUDA library, a symbol, kernel headers
    NOT_TRACKED = 7  # the process exists but publishes no llmobs map (not instrumented / not PyTorch)
    HOST_UNSUPPORTED = 8  # `doctor`: this host cannot run even the CPU probe profile
    NOTHING_ATTACHED = 9  # every probe of the chosen profiles failed to attach
    NO_GPU = 10
    STORE_ERROR = 11
    GPU_BUSY = 12  # `trace`: another tool (the PyTorch profiler, Nsight) owns CUPTI in the process
    NO_RESPONSE = 13  # `trace`, `replay`: the process did not answer the control block in time (idle?)
    UNKNOWN_REQUEST = 14  # `replay`: the flight recorder keeps no request that holds that token step
    REPLAY_BUSY = 15  # `replay`: the workload is running another replay
    NO_RECORDER = 16  # `replay`: the workload runs without a flight recorder (llmobs.Recorder)
    REPLAY_TIMEOUT = 17  # `replay`: the replay was accepted but its result did not appear in time
    REPLAY_FAILED = 18  # `replay`: the workload could not replay (prompt gone, replay raised): stored
    NO_MATCH = 19  # `compare`: a selector matches no request in its store
    NO_PAIRS = 20  # `compare`: both selectors match requests, but no request of A pairs with one of B
    MIRROR_LISTEN = 22  # `mirror`: cannot listen on --listen (the port is in use, or not ours to bind)
    PRIMARY_UNREACHABLE = 23  # `mirror`: --primary accepts no connection at start


class LlmobsError(Exception):
    """Base class: a problem the user can act on. `hint` says what to do."""

    exit_code = ExitCode.FAILURE
    default_hint = ""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint if hint is not None else self.default_hint


class NoSuchProcess(LlmobsError):
    exit_code = ExitCode.NO_SUCH_PROCESS
    default_hint = "check the pid with `ps -p PID`; the process may have exited"


class AccessDenied(LlmobsError):
    exit_code = ExitCode.ACCESS_DENIED
    default_hint = "run as root (sudo), or grant CAP_BPF and CAP_PERFMON"


class MalformedMap(LlmobsError):
    exit_code = ExitCode.MALFORMED_MAP
    default_hint = "the workload and the agent may disagree on the ABI version; upgrade both"


class MissingLibrary(LlmobsError):
    exit_code = ExitCode.MISSING_LIBRARY
    default_hint = "run scripts/setup.sh, or `llmobs-agent doctor` to see what this host lacks"


class NotTracked(LlmobsError):
    exit_code = ExitCode.NOT_TRACKED
    default_hint = "add `import llmobs; llmobs.instrument(model)` to the PyTorch program"


class HostUnsupported(LlmobsError):
    exit_code = ExitCode.HOST_UNSUPPORTED
    default_hint = "run `llmobs-agent doctor` and fix the rows marked MISSING"


class NothingAttached(LlmobsError):
    exit_code = ExitCode.NOTHING_ATTACHED
    default_hint = "check the profile against the libraries the process has loaded (/proc/PID/maps)"


class NoGpu(LlmobsError):
    exit_code = ExitCode.NO_GPU
    default_hint = "this command needs an NVIDIA GPU and driver; `llmobs-agent doctor` shows what is missing"


class StoreError(LlmobsError):
    exit_code = ExitCode.STORE_ERROR
    default_hint = "check the --db path and that no other agent holds the DuckDB file open for writing"


class GpuBusy(LlmobsError):
    exit_code = ExitCode.GPU_BUSY
    default_hint = "stop the PyTorch profiler (or Nsight) in the process, or trace it after it is done"


class NoResponse(LlmobsError):
    exit_code = ExitCode.NO_RESPONSE
    default_hint = "a process handles commands when a token step starts: is it generating? raise --timeout"


class UnknownRequest(LlmobsError):
    exit_code = ExitCode.UNKNOWN_REQUEST
    default_hint = (
        "the recorder keeps the live requests and the last keep_ended ended ones: replay a newer step, or"
        " raise llmobs.Recorder(keep_ended=N) in the workload"
    )


class ReplayBusy(LlmobsError):
    exit_code = ExitCode.REPLAY_BUSY
    default_hint = "one replay runs at a time per process: try again when it is done"


class NoRecorder(LlmobsError):
    exit_code = ExitCode.NO_RECORDER
    default_hint = "instrument with `llmobs.instrument(model, recorder=llmobs.Recorder())` (docs/replay.md)"


class ReplayTimeout(LlmobsError):
    exit_code = ExitCode.REPLAY_TIMEOUT
    default_hint = "a long window on a busy host takes longer: raise --timeout or shrink --window"


class ReplayFailed(LlmobsError):
    exit_code = ExitCode.REPLAY_FAILED
    default_hint = 'the reason is stored with the replay: llmobs-agent query "SELECT * FROM replays"'


class NoMatch(LlmobsError):
    exit_code = ExitCode.NO_MATCH
    default_hint = (
        'list what the store holds: llmobs-agent query "SELECT key, value, count(*) FROM request_labels'
        ' GROUP BY ALL" (selectors: docs/compare.md)'
    )


class NoPairs(LlmobsError):
    exit_code = ExitCode.NO_PAIRS
    default_hint = (
        "pairs need the same prompt (trace id / prompt hash) or shadow scoring on both sides; "
        "--by-intent pairs paraphrases by their intent fingerprint (docs/compare.md)"
    )


class MirrorListenFailed(LlmobsError):
    exit_code = ExitCode.MIRROR_LISTEN
    default_hint = "choose another --listen port (HOST:0 picks a free one and prints it)"


class PrimaryUnreachable(LlmobsError):
    exit_code = ExitCode.PRIMARY_UNREACHABLE
    default_hint = "start the primary server first, or fix --primary (every client request goes there)"


class UsageError(LlmobsError):
    """Bad command-line arguments: a missing or malformed option, or options that exclude each other."""

    exit_code = ExitCode.USAGE
    default_hint = "see `llmobs-agent COMMAND --help`"


class ConfigError(UsageError):
    """A bad setting of the daemon's configuration (file, LLMOBS_* variable or flag)."""

    exit_code = ExitCode.USAGE
    default_hint = "see docs/daemon.md for the keys, their allowed values and the LLMOBS_* variables"
