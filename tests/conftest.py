"""Test tiers: `unit` (no privileges), `bpf` (root + the real kernel), `gpu` (real CUDA), `e2e` (real
processes and a real OTLP collector on loopback, no privileges).

Locally a bpf test skips when we are not root. With CI=true a skipped or failed bpf test fails the
whole run: CI must exercise the real kernel, and a silently skipped tier would look like a pass.
"""

from __future__ import annotations

import os

import pytest

_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_bpf_not_passed: list[str] = []
_bpf_passed: list[str] = []


def _tier_of(item: pytest.Item) -> str:
    path = str(item.path)
    for tier in ("bpf", "gpu", "e2e", "unit"):
        if f"{os.sep}tests{os.sep}{tier}{os.sep}" in path:
            return tier
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier from its folder, and skip tiers this host cannot run."""
    is_root = os.geteuid() == 0
    has_gpu = _has_nvidia_gpu()
    for item in items:
        tier = _tier_of(item)
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "bpf" and not is_root:
            item.add_marker(pytest.mark.skip(reason="bpf tier needs root (run the tests with sudo)"))
        if tier == "gpu" and not has_gpu:
            reason = "no NVIDIA GPU here; scripts/gpu_check.sh runs this tier on one"
            item.add_marker(pytest.mark.skip(reason=reason))


def _has_nvidia_gpu() -> bool:
    """A GPU node has the driver's control device; the gpu tier needs nothing less."""
    return os.path.exists("/dev/nvidiactl") and os.path.exists("/dev/nvidia0")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "bpf" not in report.keywords:
        return
    if report.when == "call" and report.passed:
        _bpf_passed.append(report.nodeid)
    elif report.skipped or report.failed:
        _bpf_not_passed.append(f"{report.nodeid} ({report.outcome} in {report.when})")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _remove_maps_of_killed_workloads()
    if not _IN_CI or session.config.option.collectonly:
        return
    if _bpf_not_passed or not _bpf_passed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _remove_maps_of_killed_workloads() -> None:
    """Tests SIGKILL workloads on purpose; their /dev/shm maps must not pile up on CI machines."""
    try:
        from llmobs.shm.reader import remove_stale_maps

        remove_stale_maps()
    except (ImportError, OSError):
        pass


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _IN_CI:
        return
    if _bpf_not_passed:
        terminalreporter.write_line(
            "CI=true: the bpf tier must run for real; these did not pass: " + "; ".join(_bpf_not_passed),
            red=True,
        )
    elif not _bpf_passed:
        terminalreporter.write_line("CI=true: no bpf test ran; the bpf tier must run for real", red=True)
    else:
        terminalreporter.write_line(f"CI=true: bpf tier ran for real ({len(_bpf_passed)} passed)")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded once for the session (a load took ~40 s of the suite, twice): the tests that
    use it only add forward hooks, and remove them."""
    from llmobs.workloads.models import load_model

    return load_model("smollm2")
