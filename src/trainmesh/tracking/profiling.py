"""A ``torch.profiler`` trace of a run's last steps, and where their time went (kernels, device idle on the
host). As torchtitan, every rank writes its own Chrome trace; rank 0 prints the top ops. Profiled steps
run slower, so profile a few at the end."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

TOP_OPS = 15


class StepProfiler:
    """Profiles steps ``first`` (or the first run, if later) to ``last``, from :meth:`before` the first to
    :meth:`after` the last, stopping before the final evaluation, whose recompiles would swamp a few steps."""

    def __init__(self, first: int, last: int, device: torch.device) -> None:
        self.first, self.last, self.device = first, last, device
        self._prof: profile | None = None
        self._start = 0.0
        self._wall_us = 0.0

    def before(self, step: int) -> None:
        if step >= self.first and self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities)
            self._prof.start()
            self._start = time.perf_counter()

    def after(self, step: int) -> None:
        if step == self.last and self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._wall_us = (time.perf_counter() - self._start) * 1e6
            self._prof.stop()

    def finish(self, trace: Path | None) -> str:
        """Write the trace to ``trace`` (if given) and return the summary: the top ops by their own time on the device
        (the CPU when there is none) and, on a GPU, the fraction of the profiled wall time in which some kernel ran."""
        if self._prof is None:
            return "profile: no step ran (the run had already reached --steps)"
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(trace))
        on_device = self.device.type == "cuda"
        table = self._prof.key_averages().table(
            sort_by="self_device_time_total" if on_device else "self_cpu_time_total", row_limit=TOP_OPS)
        if not on_device:
            return table
        kernels = [(e.time_range.start, e.time_range.end) for e in self._prof.events()
                   if e.device_type == DeviceType.CUDA]
        return (f"{table}\ndevice busy {busy_us(kernels) / self._wall_us:.1%} of the profiled "
                f"{self._wall_us / 1e3:,.1f} ms")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time in which at least one kernel ran, with
    kernels overlapping on several streams counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
