"""CPU time and resident memory of the server and engine processes, read from /proc (Linux; elsewhere
the figures stay empty), and GPU use through NVML when there is a GPU."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class ProcessUsage:
    cpu_busy_cores: dict[str, float] = field(default_factory=dict)  # process name -> cores busy
    rss_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuStats:
    utilization: float  # 0-1
    memory_used_bytes: int


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class ProcessSampler:
    """Busy cores = CPU seconds used since the last sample / wall seconds since it."""

    def __init__(self) -> None:
        self.engine_pid: int | None = None
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (wall time, cpu seconds)

    def sample(self) -> ProcessUsage:
        usage = ProcessUsage()
        pids = {"server": os.getpid()}
        if self.engine_pid is not None:
            pids["engine"] = self.engine_pid
        now = time.monotonic()
        for name, pid in pids.items():
            cpu, rss = _cpu_seconds(pid), _rss_bytes(pid)
            if rss is not None:
                usage.rss_bytes[name] = rss
            if cpu is None:
                continue
            last = self._last.get(pid)
            self._last[pid] = (now, cpu)
            if last is not None and now > last[0]:
                usage.cpu_busy_cores[name] = max(0.0, (cpu - last[1]) / (now - last[0]))
        return usage


def gpu_stats() -> GpuStats | None:
    """The first visible GPU's utilization and used memory through NVML (the nvidia-ml-py package, which
    CUDA builds of torch install); None without it or without a GPU. NVML needs no CUDA context, so the
    server process does not take GPU memory for it."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]

        pynvml.nvmlInit()
        index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # no package, no driver, no device, or a UUID in CUDA_VISIBLE_DEVICES
        return None
    return GpuStats(rates.gpu / 100.0, int(memory.used))
