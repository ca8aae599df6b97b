"""Telemetry sampled in a background thread, on the run's clock so it joins the request records.

GPU series (utilisation, memory, power, SM clock, PCIe tx/rx) come from NVML through
nvidia-ml-py; CPU and memory of this process and of the system from psutil. CPU percentages
are shares of all logical cores (0-100, whatever the core count): the process's from its CPU
time over the wall time since the previous sample, so a sample right after start cannot read
1,200% off a millisecond interval. Without a GPU or
NVML the GPU series are absent and `gpu_unavailable` says why; the run goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class TelemetrySampler:
    def __init__(self, clock: Callable[[], float], hz: float = 10.0, gpu_index: int = 0) -> None:
        if hz <= 0:
            raise ValueError(f"telemetry rate must be > 0 Hz, got {hz}")
        self.clock, self.period, self.gpu_index = clock, 1.0 / hz, gpu_index
        self.samples: list[dict[str, Any]] = []
        self.gpu_unavailable: str | None = None
        self.gpu_name: str | None = None
        self.driver: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None

    def start(self) -> None:
        import psutil  # noqa: PLC0415

        self._process = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        self._last_cpu = (time.perf_counter(), self._cpu_seconds())
        psutil.cpu_percent(None)  # the first call only primes the system counters
        self._open_nvml()
        self._thread = threading.Thread(target=self._loop, name="pwbench-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.samples.append(self.sample())  # the series reaches the run's end
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def _open_nvml(self) -> None:
        try:
            import pynvml  # noqa: PLC0415  (the nvidia-ml-py package)
        except ImportError:
            self.gpu_unavailable = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            self.gpu_name = _text(pynvml.nvmlDeviceGetName(self._handle))
            self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
            self._nvml = pynvml
        except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound on machines without a GPU driver
            self.gpu_unavailable = f"NVML unavailable: {exc}"

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(self.sample())

    def _cpu_seconds(self) -> float:
        t = self._process.cpu_times()
        return t.user + t.system

    def _process_cpu_share(self) -> float:
        wall, cpu = time.perf_counter(), self._cpu_seconds()
        (wall0, cpu0), self._last_cpu = self._last_cpu, (wall, cpu)
        return min(100.0, max(0.0, (cpu - cpu0) / max(wall - wall0, 1e-9) / self._cores * 100))

    def sample(self) -> dict[str, Any]:
        import psutil  # noqa: PLC0415

        row: dict[str, Any] = {
            "t_s": self.clock(),
            "process_cpu_percent": self._process_cpu_share(),
            "system_cpu_percent": psutil.cpu_percent(None),
            "process_rss_bytes": self._process.memory_info().rss,
            "system_memory_used_bytes": psutil.virtual_memory().used,
        }
        if self._nvml is not None:
            nv, h = self._nvml, self._handle
            for key, read in (
                ("gpu_util_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("gpu_memory_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("gpu_power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                ("gpu_sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                # NVML reports PCIe throughput in KB/s over its last 20 ms window.
                ("pcie_tx_bytes_per_s", lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024),
                ("pcie_rx_bytes_per_s", lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024),
            ):
                try:
                    row[key] = read()
                except nv.NVMLError:
                    row[key] = None
        return row

    def describe(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "period_s": self.period,
            "cpu_percent": f"share of all {getattr(self, '_cores', 1)} logical cores (0-100)",
            "gpu": self.gpu_name,
            "driver": self.driver,
            "gpu_unavailable": self.gpu_unavailable,
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def now_clock(t0: float) -> Callable[[], float]:
    """The run's clock: seconds since t0 on time.perf_counter."""
    return lambda: time.perf_counter() - t0
