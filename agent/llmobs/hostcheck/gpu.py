"""GPU checks: libcuda on disk, the CUDA driver initialising, NVML, and cupti-python.

All GPU libraries are loaded lazily and only here, so the agent and this report run on machines
without them; each row names what is missing and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess

from llmobs.hostcheck.model import Context, Finding, Status

INSTALL_DRIVER = "install the NVIDIA driver (only the cuda probe profile, NVML and CUPTI need it)"

# Where drivers put libcuda when the loader cache does not list it (containers, the GPU operator, WSL).
COMMON_LIBCUDA_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1",
)

# A few CUresult codes worth naming when cuGetErrorName itself is unavailable.
CU_ERRORS = {
    3: "CUDA_ERROR_NOT_INITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}


def parse_ldconfig(text: str, soname: str) -> list[str]:
    """Paths of `soname` (e.g. "libcuda.so.1") in `ldconfig -p` output, stub libraries left out:
    a CUDA toolkit's stubs/libcuda.so links but is not a driver."""
    paths = []
    for line in text.splitlines():
        name, arrow, path = line.strip().partition(" => ")
        if arrow and name.split(" ", 1)[0] == soname and "/stubs/" not in path:
            paths.append(path.strip())
    return paths


def _ldconfig_cache() -> str:
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            return subprocess.run(
                [ldconfig, "-p"], capture_output=True, text=True, timeout=3, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ""


def find_libcuda(ctx: Context, ldconfig_text: str | None = None) -> tuple[str | None, str]:
    """(the driver's libcuda.so.1 or None, where it was found or looked for): the loader cache, the
    common driver paths, then ctypes.util.find_library (which also searches LD_LIBRARY_PATH)."""
    if ldconfig_text is None:
        ldconfig_text = _ldconfig_cache() if ctx.live else ""
    for path in parse_ldconfig(ldconfig_text, "libcuda.so.1"):
        if ctx.path(path).exists():
            return path, "the ldconfig cache"
    for path in COMMON_LIBCUDA_PATHS:
        if ctx.path(path).exists():
            return path, "a common driver path"
    if ctx.live:
        found = ctypes.util.find_library("cuda")
        if found and "stub" not in found:
            return found, "ctypes.util.find_library"
    return None, "the ldconfig cache, " + ", ".join(COMMON_LIBCUDA_PATHS[:3]) + ", ..."


def check_libcuda(ctx: Context) -> Finding:
    path, where = find_libcuda(ctx)
    if path is None:
        return Finding(Status.MISSING, f"no libcuda.so.1 in {where}", INSTALL_DRIVER)
    ctx.state["libcuda"] = path
    return Finding(Status.OK, f"{path} (from {where})")


def _cu_error_name(lib: ctypes.CDLL, code: int) -> str:
    try:
        name = ctypes.c_char_p()
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except AttributeError:
        pass
    return CU_ERRORS.get(code, f"CUresult {code}")


def check_cuda_driver(ctx: Context) -> Finding:
    path = ctx.state.get("libcuda")
    if path is None:
        return Finding(Status.MISSING, "not tried: no libcuda.so.1 (see the libcuda row)", INSTALL_DRIVER)
    if not ctx.live:
        return Finding(Status.MISSING, f"not tried: checking a fake root ({ctx.root})")
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return Finding(Status.MISSING, f"cannot load {path}: {exc}", INSTALL_DRIVER)
    code = lib.cuInit(0)
    if code != 0:
        name = _cu_error_name(lib, code)
        hint = "no GPU visible to this host or container" if code == 100 else "check `nvidia-smi` and dmesg"
        return Finding(Status.MISSING, f"cuInit(0) failed: {name}", hint)
    version = ctypes.c_int()
    count = ctypes.c_int()
    lib.cuDriverGetVersion(ctypes.byref(version))
    lib.cuDeviceGetCount(ctypes.byref(count))
    v = version.value
    return Finding(
        Status.OK, f"cuInit ok: CUDA driver API {v // 1000}.{v % 1000 // 10}, {count.value} device(s)"
    )


def check_nvml(ctx: Context) -> Finding:
    if not ctx.live:
        return Finding(Status.MISSING, f"not tried: checking a fake root ({ctx.root})")
    try:
        import pynvml  # imported lazily: NVML is optional
    except ImportError as exc:
        return Finding(Status.MISSING, f"cannot import pynvml ({exc})", "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Finding(Status.MISSING, f"nvmlInit failed: {exc}", INSTALL_DRIVER)
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    if isinstance(driver, bytes):
        driver = driver.decode()
    if count == 0:
        return Finding(Status.DEGRADED, f"NVML up (driver {driver}) but no devices", "check `nvidia-smi`")
    return Finding(Status.OK, f"NVML: driver {driver}, {count} device(s)")


def check_cupti(ctx: Context) -> Finding:
    if not ctx.live:
        return Finding(Status.MISSING, f"not tried: checking a fake root ({ctx.root})")
    try:
        from cupti import cupti  # imported lazily: CUPTI is optional
    except ImportError as exc:
        return Finding(
            Status.MISSING, f"cannot import cupti-python ({exc})", "pip install 'llmobs-agent[gpu]'"
        )
    try:
        # The cheapest call that needs both libcupti and the driver behind it.
        cupti.get_timestamp()
    except Exception as exc:  # cupti-python raises its own error classes; any failure is the answer
        return Finding(Status.MISSING, f"cupti-python imports, but CUPTI cannot run: {exc}", INSTALL_DRIVER)
    return Finding(Status.OK, "cupti-python imports and reads the CUPTI clock")
