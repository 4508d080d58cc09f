"""Host (psutil) and GPU (NVML via nvidia-ml-py) sampling on a background thread: every `interval_s` during the
profiling window, every second otherwise (each sample reads /proc and holds the GIL briefly)."""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Optional


def _nvml_device_index(local_rank: int, device_count: int) -> int:
    """The GPU a rank most likely uses: its entry of CUDA_VISIBLE_DEVICES, else local_rank, wrapping round when
    several ranks share the GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if local_rank < len(ids) and ids[local_rank].isdigit():
            return int(ids[local_rank])
        if ids and all(part.isdigit() for part in ids):
            return int(ids[local_rank % len(ids)])
    return local_rank % device_count if device_count else local_rank


class NvmlProbe:
    """Reads one GPU's utilisation, memory and power; records why when NVML is unavailable."""

    def __init__(self, local_rank: int):
        self.handle = None
        self.status = "unavailable"
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            index = _nvml_device_index(local_rank, count)
            if count == 0:
                self.status = "unavailable: no NVIDIA GPU"
            elif index >= count:
                self.status = f"unavailable: GPU index {index} >= device count {count}"
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._nvml = pynvml
                self.status = f"ok: gpu{index} {pynvml.nvmlDeviceGetName(self.handle)}"
        except Exception as exc:  # NVMLError_LibraryNotFound, ImportError, driver problems
            self.status = f"unavailable: {type(exc).__name__}: {exc}"

    def read(self) -> Optional[dict[str, float]]:
        if self.handle is None:
            return None
        nvml = self._nvml
        util = nvml.nvmlDeviceGetUtilizationRates(self.handle)
        mem = nvml.nvmlDeviceGetMemoryInfo(self.handle)
        values = {"gpu_util_pct": float(util.gpu), "mem_util_pct": float(util.memory),
                  "mem_used_bytes": float(mem.used)}
        try:
            values["power_w"] = nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
        except Exception:
            pass
        return values


class Sampler:
    """Samples the rank process (CPU %, RSS) and its GPU every `interval_s` into a bounded buffer."""

    def __init__(self, interval_s: float, local_rank: int, clock_us: Callable[[], float], max_samples: int = 50000,
                 fast: Callable[[], bool] = lambda: True, idle_interval_s: float = 1.0):
        self.interval_s = max(0.01, interval_s)
        self.idle_interval_s = max(self.interval_s, idle_interval_s)
        self.fast = fast  # sample at interval_s while this says so (the profiling window), else every idle_interval_s
        self.clock_us = clock_us
        self.samples: collections.deque = collections.deque(maxlen=max_samples)
        self.nvml = NvmlProbe(local_rank)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            import psutil

            self._proc = psutil.Process()
            self._proc.cpu_percent(None)
            psutil.cpu_percent(None)
            self._psutil = psutil
            self.host_status = "ok"
        except Exception as exc:
            self._psutil = None
            self.host_status = f"unavailable: {exc}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dpro-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s if self.fast() else self.idle_interval_s):
            try:
                self.sample_once()
            except Exception:
                return  # sampling is best-effort; never disturb the training process

    def sample_once(self) -> None:
        now = self.clock_us()
        if self._psutil is not None:
            mem = self._proc.memory_info()
            self.samples.append((now, "host", {
                "proc_cpu_pct": self._proc.cpu_percent(None),
                "host_cpu_pct": self._psutil.cpu_percent(None),
                "rss_bytes": float(mem.rss),
            }))
        gpu = self.nvml.read()
        if gpu is not None:
            self.samples.append((now, "gpu", gpu))

    def export(self) -> dict:
        return {
            "host_status": self.host_status,
            "nvml_status": self.nvml.status,
            "interval_s": self.interval_s,
            "samples": [{"t": t, "src": src, "v": values} for t, src, values in list(self.samples)],
        }
