"""Per-step metrics: the JSON lines file, the summary, the progress line, and memory accounting.

``model_state_bytes`` counts the bytes of parameters, gradients and optimizer state a rank actually
holds, each storage once (a gradient that is a view into a bucket counts as part of the bucket) and a
freed tensor not at all; it is the quantity the ZeRO paper's memory formulas predict.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from trainmesh.safe_io import replace_durably


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def model_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's state tensors of a replicated model."""
    params = list(model.parameters())
    return params + [p.grad for p in params if p.grad is not None] + optimizer_tensors(optimizer)


class SavedActivations:
    """Bytes of the tensors autograd saves for backward while active, parameters excluded.

    This is the activation memory of a forward pass as backward will need it: tensors dropped by
    activation recomputation are never saved, so they are not counted.

    A saved tensor is a parameter (or a view of one) if it shares the storage a parameter has *at pack
    time*: ZeRO-3 gathers each unit into a freshly allocated buffer every pass, so addresses taken at
    construction go stale (and a freed unit's old address may come back as an activation's).
    """

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._exclude = list(exclude)
        self._seen: dict[int, int] = {}
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in {p.untyped_storage().data_ptr() for p in self._exclude}:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator["SavedActivations"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self.bytes = sum(self._seen.values())


def max_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# Dense bf16 tensor-core peaks (vendor datasheets, SXM parts), matched against torch's device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0}


def peak_tflops(device: torch.device, override: float = 0.0) -> float:
    """The per-device peak that MFU divides by: ``override`` if given, else the table; 0 if unknown."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_BF16_TFLOPS.items() if key in name), 0.0)


def mfu(tokens_per_s: float, flops_per_token: int, world_size: int, peak: float) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices (None if unknown)."""
    return tokens_per_s * flops_per_token / (world_size * peak * 1e12) if peak > 0 else None


def peak_device_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


class MetricsError(RuntimeError):
    """A metrics file could not be written; the message names the file and the error."""


def _drop_torn_tail(fd: int) -> None:
    """Cut a last line that a crash left without its newline, so appended lines stay whole JSON."""
    size = os.lseek(fd, 0, os.SEEK_END)
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return
    start = max(0, size - 2**20)
    tail = os.pread(fd, size - start, start)
    os.ftruncate(fd, start + tail.rfind(b"\n") + 1 if b"\n" in tail else 0)


class MetricsWriter:
    """Writes ``metrics.jsonl`` (one object per step) and ``summary.json``; a no-op off rank 0.

    Each line goes to the file in one ``write`` call on an ``O_APPEND`` descriptor, so the file only ever
    holds whole lines: a write the disk cannot take (``ENOSPC``) is cut back to the previous line's end
    and raised as :class:`MetricsError` naming the file, and the run stops (see ``train``).
    """

    def __init__(self, out_dir: str | None, enabled: bool, append: bool = False) -> None:
        """``append`` keeps the steps already written (a resumed or restarted run continues the file)."""
        self.enabled = enabled and bool(out_dir)
        self.dir = Path(out_dir) if out_dir else None
        self.path = self.dir / "metrics.jsonl" if self.dir else None
        self._fd: int | None = None
        if self.enabled:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC),
                                   0o644)
                if append:
                    _drop_torn_tail(self._fd)
            except OSError as e:
                raise MetricsError(f"opening {self.path} failed: {e.strerror or e}") from None

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        line = (json.dumps(record) + "\n").encode()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            if os.write(self._fd, line) != len(line):
                raise OSError(errno.ENOSPC, f"only part of a {len(line)}-byte line was written")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise MetricsError(f"writing {self.path} failed: [Errno {e.errno}] {e.strerror}") from None

    def summary(self, record: dict[str, Any]) -> None:
        if self.enabled:
            path = self.dir / "summary.json"
            try:
                replace_durably(path, (json.dumps(record, indent=2) + "\n").encode())
            except OSError as e:
                raise MetricsError(f"writing {path} failed: [Errno {e.errno}] {e.strerror}") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Progress:
    """A one-line progress bar with loss, tokens/s and step time, redrawn in place on a terminal."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stdout, width: int = 24) -> None:
        self.total, self.enabled, self.stream, self.width = total, enabled, stream, width
        self.tty = stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, step_time_s: float) -> None:
        if not self.enabled:
            return
        done = int(self.width * step / self.total)
        bar = "#" * done + "." * (self.width - done)
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} | "
                f"{tokens_per_s:,.0f} tok/s | {step_time_s * 1000:.0f} ms/step")
        end = "\r" if self.tty and step < self.total else "\n"
        self.stream.write(line + end)
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
