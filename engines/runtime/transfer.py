"""TransferLedger: the single place where host<->device traffic is made and counted.

Every copy the runtime makes between host memory and the device goes through `to_device` /
`to_host` (or is reported with `record` when a kernel or a side stream does the copy), so
bytes moved per step and per token are exact, not estimated. When the device is the CPU
nothing crosses a bus and nothing is counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TransferCounts:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_transfers: int = 0
    d2h_transfers: int = 0


class TransferLedger:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.crosses_bus = device.type != "cpu"
        self._step = Counter[str]()  # since the latest take_step
        self._before = Counter[str]()  # the steps taken before it (total = _before + _step)
        self._meta: dict[tuple, Tensor] = {}  # (shape, dtype) -> a meta tensor (simulated runs)
        self._names: dict[tuple[str, str], tuple[str, str, str]] = {}  # (direction, tag) -> counter names

    def to_device(self, tensor: Tensor, tag: str = "data", non_blocking: bool = False) -> Tensor:
        if tensor.device == self.device:
            return tensor
        out = tensor.to(self.device, non_blocking=non_blocking)
        if self.crosses_bus:
            self.record("h2d", tensor.numel() * tensor.element_size(), tag)
        return out

    def to_host(self, tensor: Tensor, tag: str = "data") -> Tensor:
        if tensor.device.type == "cpu":
            return tensor
        self.record("d2h", tensor.numel() * tensor.element_size(), tag)
        return tensor.to("cpu")

    def tensor(self, data: list, dtype: torch.dtype, tag: str = "data") -> Tensor:
        """Build a tensor from host data and move it to the device (counted). On the meta device
        (a simulated run) only the shape is built: the same tensor a copy would give, the same
        bytes counted, without making the host tensor first."""
        if self.device.type == "meta":
            return self.shaped(_shape(data), dtype, tag)
        return self.to_device(torch.tensor(data, dtype=dtype), tag)

    def shaped(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str = "data") -> Tensor:
        """On the meta device (a simulated run): what `tensor` gives for data of `shape`, counted the
        same, for a caller that knows the shape without building the data."""
        # Meta tensors hold no data, so one per (shape, dtype) serves every step (a
        # simulated step builds several: torch.empty costs ~5 us each).
        key = (shape, dtype)
        out = self._meta.get(key)
        if out is None:
            if len(self._meta) > 4096:
                self._meta.clear()
            out = self._meta[key] = torch.empty(shape, dtype=dtype, device=self.device)
        if self.crosses_bus:
            self.record("h2d", out.numel() * out.element_size(), tag)
        return out

    def record(self, direction: str, nbytes: int, tag: str = "data", transfers: int = 1) -> None:
        names = self._names.get((direction, tag))
        if names is None:  # the counters' names per (direction, tag), made once
            if direction not in ("h2d", "d2h"):
                raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
            names = self._names[(direction, tag)] = (f"{direction}:bytes", f"{direction}:count", f"{direction}:{tag}")
        total, count, tagged = names
        step = self._step  # folded into the run's total at take_step (a record is one step's only)
        step[total] += nbytes
        step[count] += transfers
        step[tagged] += nbytes

    @property
    def total(self) -> Counter[str]:
        """Counts since start, per "direction:bytes", "direction:count" and "direction:tag" (a copy)."""
        return self._before + self._step

    def total_of(self, key: str) -> int:
        """`total[key]` without building the whole sum (read every step by engine full)."""
        return self._before[key] + self._step[key]

    def peek_step(self) -> TransferCounts:
        """Counts since the previous take_step, without resetting them."""
        c = self._step
        return TransferCounts(c["h2d:bytes"], c["d2h:bytes"], c["h2d:count"], c["d2h:count"])

    def take_step(self) -> TransferCounts:
        """Counts since the previous call (one engine step), then reset."""
        counts = self.peek_step()
        self._before.update(self._step)
        self._step = Counter()
        return counts


def _shape(data: list) -> tuple[int, ...]:
    """The shape torch.tensor(data) has for nested lists of numbers (rectangular, as built here)."""
    shape: list[int] = []
    while isinstance(data, (list, tuple)):
        shape.append(len(data))
        if not data:
            break
        data = data[0]
    return tuple(shape)
