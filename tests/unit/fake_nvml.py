"""NVIDIA's pynvml module stood in for (there is no GPU here): the functions the agent calls, with
pynvml's names and return shapes, for two devices; process 100 runs kernels on device 0."""

from __future__ import annotations

import threading
from types import SimpleNamespace as NS


class FakeNvml:
    """pynvml's functions for two devices; process 100 runs kernels on device 0."""

    def __init__(self, devices=2):
        self.devices = devices
        self.shutdowns = 0
        self.calls = 0
        self.sampled = threading.Event()

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000-{h}"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetUtilizationRates(self, h):
        self.calls += 1
        if self.calls >= 4:
            self.sampled.set()
        return NS(gpu=75 if h == "h0" else 0, memory=30 if h == "h0" else 0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return NS(used=5 << 30, total=141 << 30)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [NS(pid=100, usedGpuMemory=3 << 30)] if h == "h0" else []

    def nvmlDeviceGetProcessUtilization(self, h, last_seen):
        if h != "h0":
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return [NS(pid=100, smUtil=70, memUtil=25, timeStamp=last_seen + 1000)]
