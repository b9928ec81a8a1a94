"""A run directory as a public object: what ``trainmesh train`` writes, for any training loop.

:class:`RunLog` is the one writer of a run's ``metrics.jsonl``, ``summary.json``, TensorBoard events (and
W&B) and progress line, so ``trainmesh report`` reads a script's run as the command line's (docs/api.md).
Every rank calls :meth:`RunLog.log`; only global rank 0 writes and holds the directory's lock."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmesh.tracking import runlock
from trainmesh.distributed.mesh import world_env
from trainmesh.tracking.metrics import PER_RANK_STATS, per_rank_stats
from trainmesh.tracking.records import LossWindows, MetricsError, MetricsWriter, Progress, open_sinks

if TYPE_CHECKING:
    from trainmesh.api import ParallelModel


class RunLog:
    """Metrics, summary, TensorBoard events and progress of one training run in directory ``out``.

    ``steps``/``first_step``: the run's last and this process's first step; ``resume_from``: the checkpoint's
    step (later records dropped; None starts afresh); ``model``, ``config``: what is recorded; ``lock``: hold
    ``out``'s lock (False where the launching process already does)."""

    def __init__(self, out: str | Path, steps: int = 0, *, first_step: int = 1, resume_from: int | None = None,
                 model: ParallelModel | None = None, config: dict[str, Any] | None = None, name: str = "",
                 tensorboard: bool = True, wandb: str = "", progress: bool = True, progress_every: int = 0,
                 lock: bool = True) -> None:
        self.out, self.model, self.steps = Path(out), model, steps
        self.writes = world_env().rank == 0 and bool(str(out))
        self.name = name or (model.description[1]["source"] if model is not None else "")
        self.config = {**(model.layout.record() if model is not None else {}), "model": self.name, **(config or {})}
        self._held = contextlib.ExitStack()
        if self.writes and lock:
            self.out.mkdir(parents=True, exist_ok=True)
            self._held.enter_context(runlock.hold(self.out, "--out"))
        sinks = open_sinks(self.out, tensorboard, wandb, self.config, resume_from) if self.writes else []
        self.writer = MetricsWriter(str(self.out), enabled=self.writes, resume_from=resume_from, sinks=sinks)
        self.progress = Progress(steps, first_step, sys.stdout if world_env().rank == 0 else None, enabled=progress,
                                 every=progress_every)
        self.losses: list[float] = []
        self.times: list[float] = []
        self._last = time.perf_counter()
        self._comm_before = self._comm()
        self._summarized = False

    def _comm(self) -> dict[str, float]:
        return self.model.comm.snapshot() if self.model is not None else {}

    def log(self, step: int, loss: float, tokens: int = 0, **metrics: Any) -> None:
        """Record step ``step`` (1-based): ``loss``, elapsed time, ``tokens`` and any JSON ``metrics``; with a model,
        also communication per axis, every rank's memory (a collective) and, first, the layout. Raises
        :class:`~trainmesh.tracking.records.MetricsError` if the record cannot be written; the run should stop."""
        now = time.perf_counter()
        step_time, self._last = metrics.pop("step_time_s", now - self._last), now
        record: dict[str, Any] = {"step": step, "loss": loss, "step_time_s": step_time}
        if tokens:
            record["tokens_per_s"] = tokens / step_time
        if self.model is not None:
            record.update(self._model_metrics(metrics.keys()))
        record.update(metrics)
        self.losses.append(loss)
        self.times.append(step_time)
        self.writer.write(record)
        self.progress.update(record)

    def _model_metrics(self, given: Any) -> dict[str, Any]:
        """What ``trainmesh train``'s records hold of the model and were not ``given``: communication since the
        last record (per ``axis/op`` and per axis), each rank's memory, and the layout in the first record."""
        out: dict[str, Any] = {}
        if "comm_bytes_by_op" not in given:
            comm = self._comm()
            out["comm_bytes_by_op"] = {k: round(v - self._comm_before.get(k, 0.0)) for k, v in comm.items()
                                       if v - self._comm_before.get(k, 0.0)}
            self._comm_before = comm
            axes: dict[str, int] = {}
            for key, n in out["comm_bytes_by_op"].items():
                axes[key.partition("/")[0]] = axes.get(key.partition("/")[0], 0) + n
            out["comm_bytes"] = axes
        if not given & set(PER_RANK_STATS):
            engine = self.model.engine
            out.update(per_rank_stats(engine.state_tensors() if engine is not None else self.model.module.parameters(),
                                      self.model.mesh.device))
        if not self.losses:
            out["layout"] = self.model.layout.record()
        return out

    def message(self, text: str) -> None:
        """Print a line of its own on rank 0 (the progress bar, if any, is redrawn below it)."""
        self.progress.message(text)

    @property
    def steady_step_time(self) -> float:
        """Mean seconds per logged step, the first left out (it pays for warm-up: allocation, compilation)."""
        steady = self.times[1:] or self.times
        return sum(steady) / len(steady)

    def summary(self, **fields: Any) -> dict[str, Any]:
        """Write ``summary.json``: the model's name, the loss windows and mean step time of what was logged,
        the settings, and ``fields``; returns it."""
        record: dict[str, Any] = {"model": self.name, "steps": self.steps or len(self.losses)}
        if self.losses:
            windows = LossWindows.of(self.losses)
            record.update(first_loss=self.losses[0], final_loss=self.losses[-1], loss_window_steps=windows.steps,
                          first_window_loss=windows.first, last_window_loss=windows.last,
                          mean_step_time_s=self.steady_step_time)
        record.update(fields)
        record.setdefault("config", self.config)
        self.writer.summary(record)
        self._summarized = True
        return record

    def close(self) -> None:
        """End the progress line, close the files and sinks and release the directory."""
        self.progress.close()
        self.writer.close()
        self._held.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, kind: type | None, *_: Any) -> None:
        try:
            if kind is None and self.losses and not self._summarized:
                self.summary()
        finally:
            self.close()


__all__ = ["RunLog", "MetricsError"]
