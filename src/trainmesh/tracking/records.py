"""A run's records: ``metrics.jsonl``, its sinks (TensorBoard, W&B), ``summary.json`` and rank 0's progress.

Steps count from 1 wherever a person reads them: step N's record and checkpoint ``step-N`` describe the
same weights, and a run resumed from ``step-N`` logs step N+1 next."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import json
import math
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TextIO


from trainmesh.storage.safe_io import open_own_file, read_regular, refuse_link, replace_durably


class MetricsError(RuntimeError):
    """A metrics file could not be written; the message names the file and the error."""


METRICS_FILE, SUMMARY_FILE, REPORT_FILE = "metrics.jsonl", "summary.json", "report.png"
EVENTS_GLOB = "events.out.tfevents.*"
METRICS_LIMIT = 2**34  # bytes a metrics file is read up to when a resumed run trims it


def run_records(run_dir: Path) -> list[Path]:
    """The records a run left in ``run_dir`` (a metrics file with at least one line, its summary, report and
    TensorBoard events): what a fresh run there would replace."""
    found = [run_dir / name for name in (SUMMARY_FILE, REPORT_FILE) if os.path.lexists(run_dir / name)]
    metrics = run_dir / METRICS_FILE
    if metrics.is_symlink() or (metrics.exists() and metrics.stat().st_size):
        found.insert(0, metrics)
    return found + sorted(run_dir.glob(EVENTS_GLOB))


def check_no_links(run_dir: Path, lock_name: str) -> None:
    """Refuse, as :class:`MetricsError`, a symbolic link at the name of a file a run writes in ``run_dir`` (metrics,
    summary, report, lock ``lock_name``, events), before the run starts; the writers never follow links either."""
    for path in (*(run_dir / name for name in (METRICS_FILE, SUMMARY_FILE, REPORT_FILE, lock_name)),
                 *run_dir.glob(EVENTS_GLOB)):
        try:
            refuse_link(path, "a run")
        except OSError as e:
            raise MetricsError(f"{e}, or choose another run directory") from None


def keep_steps_through(path: Path, step: int) -> int:
    """Rewrite ``path`` atomically keeping only whole records of steps up to ``step``, so steps a resumed run
    replays have one record; returns how many later records it dropped."""
    if not os.path.lexists(path):
        return 0
    lines = read_regular(path, METRICS_LIMIT).splitlines(keepends=True)
    kept, dropped = [], 0
    for line in lines:
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if record["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    replace_durably(path, b"".join(kept))
    return dropped


class Sink(Protocol):
    """Somewhere besides ``metrics.jsonl`` that each step's record goes (TensorBoard, W&B); ``where`` names
    it in an error."""

    where: str

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable numbers of one ``metrics.jsonl`` record under the tags every sink uses: a chart per quantity, a
    series per rank or mesh axis, and each MoE layer's balance, drops, aux and z losses and expert copies."""
    out = {tag: float(record[key]) for key, tag in (
        ("loss", "train/loss"), ("val_loss", "eval/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
        ("trained_tokens", "train/trained_tokens"),
        ("loss_scale", "train/loss_scale"), ("tokens_per_s", "perf/tokens_per_s"),
        ("step_time_s", "perf/step_time_s"), ("mfu", "perf/mfu")) if record.get(key) is not None}
    for axis, n in record.get("comm_bytes", {}).items():
        out[f"comm_bytes/{axis}"] = float(n)
    for key in ("max_rss_bytes", "peak_device_bytes", "model_state_bytes", "activation_bytes"):
        values = record.get(key) or []
        if any(values):
            out.update({f"memory/{key}/rank{r}": float(v) for r, v in enumerate(values)})
    for layer, m in record.get("moe", {}).items():
        out.update({f"moe/{layer}/{key}": float(m[key]) for key in ("balance", "dropped_fraction", "aux_loss", "z_loss")})
        out.update({f"moe/{layer}/tokens/expert{e}": float(n) for e, n in enumerate(m["expert_tokens"])})
    return {tag: v for tag, v in out.items() if math.isfinite(v)}


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class TensorBoardSink:
    """TensorBoard events in a new event file of the run directory, written when each step is logged. Not
    ``SummaryWriter``, whose thread meets a full disk alone: here each step is one write, cut back on ``ENOSPC`` and
    raised to :class:`MetricsWriter`. ``purge_step`` makes TensorBoard hide a resumed run's replayed steps."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.where = f"TensorBoard events in {log_dir}"
        self._event = Event
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        self._fd = open_own_file(log_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        start = [Event(wall_time=time.time(), step=purge_step or 0, file_version="brain.Event:2")]
        if purge_step is not None:
            start.append(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._append(start)

    def _append(self, events: list[Any]) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter

        framed = io.BytesIO()
        for event in events:
            RecordWriter(framed).write(event.SerializeToString())
        append_whole(self._fd, framed.getvalue())

    def write(self, record: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import scalar

        now = time.time()
        self._append([self._event(wall_time=now, step=record["step"], summary=scalar(tag, value))
                      for tag, value in scalars(record).items()])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to ``fd`` (opened ``O_APPEND``) in one write; if the disk cannot take all of it
    (``ENOSPC``), cut the file back to where it ended, so it holds only whole records, and raise."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, f"only part of a {len(data)}-byte record was written")
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)
        raise


WANDB_ID_FILE = "wandb-run-id"


def wandb_group(config: dict[str, Any]) -> tuple[str, str]:
    """The W&B group (the layout) and job type (the precision) of a run's settings, so W&B's grouped view
    sets runs side by side as ``trainmesh report RUN1 RUN2`` does; absent settings are left out."""
    layout = " ".join(f"{axis}{config[axis]}" for axis in ("dp", "cp", "tp", "pp", "ep", "zero")
                      if config.get(axis) is not None)
    return layout or "unknown layout", str(config.get("precision") or "unknown precision")


class WandbSink:
    """A Weights & Biases run of ``project`` under the run directory, offline unless ``WANDB_MODE`` says
    otherwise (no stall without network); its id in ``RUN_DIR/wandb-run-id`` lets a resumed run continue it."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any], resume_from: int | None = None) -> None:
        import wandb

        self.where = f"the W&B run in {run_dir}"
        id_file = run_dir / WANDB_ID_FILE
        run_id = read_regular(id_file, 256).decode().strip() if resume_from is not None and id_file.is_file() else ""
        if not run_id:
            run_dir.mkdir(parents=True, exist_ok=True)
            run_id = secrets.token_hex(4)  # a W&B run id: lowercase letters and digits
            replace_durably(id_file, run_id.encode())
        group, job_type = wandb_group(config)
        self._run = wandb.init(project=project, dir=str(run_dir), name=run_dir.name, config=config, group=group,
                               job_type=job_type, id=run_id, resume="allow",
                               mode=os.environ.get("WANDB_MODE", "offline"))

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def open_sinks(run_dir: Path, tensorboard: bool, wandb_project: str, config: dict[str, Any],
               resume_from: int | None = None) -> list[Sink]:
    """The sinks a run asked for: TensorBoard if ``tensorboard`` and installed (on by default, so absence is no
    error), W&B if ``wandb_project`` is given (checked installed before any rank spawned)."""
    sinks: list[Sink] = []
    try:
        if tensorboard and package_available("tensorboard"):
            sinks.append(TensorBoardSink(run_dir, None if resume_from is None else resume_from + 1))
        if wandb_project:
            sinks.append(WandbSink(wandb_project, run_dir, config, resume_from))
    except OSError as e:
        for sink in sinks:
            sink.close()
        raise MetricsError(f"opening the run's records in {run_dir} failed: {_reason(e)}") from None
    return sinks


def _reason(e: OSError) -> str:
    return f"[Errno {e.errno}] {e.strerror}" if e.errno else str(e)


class MetricsWriter:
    """Writes ``metrics.jsonl`` and ``summary.json`` and feeds its sinks; a no-op off rank 0. Each record is one
    ``O_APPEND`` write of a whole line; ``ENOSPC`` is cut back and raised as :class:`MetricsError`."""

    def __init__(self, out_dir: str | None, enabled: bool, resume_from: int | None = None,
                 sinks: Sequence[Sink] = ()) -> None:
        """``resume_from``: the step a resumed run's checkpoint holds; the file is cut to it and the first record
        carries ``"restart": {"from_step": N, "replayed_steps": K}``. None starts a new file."""
        self.enabled = enabled and bool(out_dir)
        self.dir = Path(out_dir) if out_dir else None
        self.path = self.dir / METRICS_FILE if self.dir else None
        self.sinks = list(sinks) if self.enabled else []
        self._fd: int | None = None
        self._restart: dict[str, int] | None = None
        if self.enabled:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                if resume_from is None:
                    flags |= os.O_TRUNC
                else:
                    self._restart = {"from_step": resume_from,
                                     "replayed_steps": keep_steps_through(self.path, resume_from)}
                self._fd = open_own_file(self.path, flags)
            except OSError as e:
                for sink in self.sinks:
                    sink.close()
                raise MetricsError(f"opening {self.path} failed: {e.strerror or e}") from None

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        if self._restart is not None:
            record, self._restart = {**record, "restart": self._restart}, None
        try:
            append_whole(self._fd, (json.dumps(record) + "\n").encode())
        except OSError as e:
            raise MetricsError(f"writing {self.path} failed: {_reason(e)}") from None
        for sink in self.sinks:
            try:
                sink.write(record)
            except OSError as e:
                self.sinks.remove(sink)
                sink.close()
                raise MetricsError(f"writing {sink.where} failed: {_reason(e)}") from None

    def summary(self, record: dict[str, Any]) -> None:
        if self.enabled:
            path = self.dir / SUMMARY_FILE
            try:
                replace_durably(path, (json.dumps(record, indent=2) + "\n").encode())
            except OSError as e:
                raise MetricsError(f"writing {path} failed: [Errno {e.errno}] {e.strerror}") from None

    def close(self) -> None:
        """Close the file and every sink; a sink that cannot finish (a full disk) is :class:`MetricsError`
        once all are closed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        failed = []
        for sink in self.sinks:
            try:
                sink.close()
            except OSError as e:
                failed.append(f"writing {sink.where} failed: {_reason(e)}")
        self.sinks = []
        if failed:
            raise MetricsError(failed[0])


@dataclass(frozen=True)
class LossWindows:
    """Mean loss over the first and the last ``steps`` steps of a run (a tenth of them, at least one), so
    that one noisy step at either end does not read as progress or its absence."""

    steps: int
    first: float
    last: float

    FRACTION = 0.1

    @classmethod
    def of(cls, losses: Sequence[float]) -> "LossWindows":
        k = max(1, round(len(losses) * cls.FRACTION))
        return cls(k, sum(losses[:k]) / k, sum(losses[-k:]) / k)

    def text(self) -> str:
        which = "step" if self.steps == 1 else f"{self.steps} steps"
        return f"loss {self.first:.4f} -> {self.last:.4f} (mean of the first and last {which})"


def clock(seconds: float) -> str:
    """``H:MM:SS`` of a duration, as progress lines show elapsed time and ETA."""
    return str(timedelta(seconds=round(seconds)))


def step_text(record: dict[str, Any], val_loss: float | None) -> str:
    """A step's numbers as progress lines show them; ``val_loss`` is the latest evaluation's."""
    val = f" | val {val_loss:.4f}" if val_loss is not None else ""
    return (f"loss {record['loss']:.4f}{val} | {record['tokens_per_s']:,.0f} tok/s | "
            f"{record['step_time_s'] * 1000:.0f} ms/step")


def _terminal(stream: TextIO) -> bool:
    """Whether ``stream`` reaches a terminal: it is one, or it is the pipe through which trainmesh's launcher
    streams this rank to one (``TRAINMESH_TERMINAL``, :data:`trainmesh.distributed.launcher.TERMINAL_ENV`)."""
    return stream.isatty() or (stream is sys.stdout and os.environ.get("TRAINMESH_TERMINAL") == "1")


class Progress:
    """What rank 0 prints: per-step progress (a tqdm bar on a terminal, else a line every ``every`` steps) and
    messages, which always print. Other terminal writes mid-run go inside :meth:`paused`."""

    def __init__(self, total: int, first: int, stream: TextIO | None, enabled: bool = True, every: int = 0) -> None:
        """``first``: the step this run starts at (later than 1 when resumed); ``stream``: where to print
        (None on every rank but 0); ``every``: steps between plain lines (0: a twentieth of the run)."""
        self.total, self.first, self.stream = total, first, stream
        self.enabled = enabled and stream is not None
        self.every = every or max(1, total // 20)
        self.start = time.perf_counter()
        self.val_loss: float | None = None
        self._bar: Any = None  # drawn at the first step, below the messages printed before it
        self._terminal = self.enabled and _terminal(stream) and package_available("tqdm")

    def _terminal_bar(self) -> Any:
        from tqdm import tqdm

        return tqdm(total=self.total, initial=self.first - 1, file=self.stream, desc="step", dynamic_ncols=True,
                    bar_format="{desc} {n_fmt}/{total_fmt} |{bar:20}| {elapsed}<{remaining}{postfix}")

    def update(self, record: dict[str, Any]) -> None:
        """Show the metrics record of a finished step (its ``val_loss``, if any, becomes the latest)."""
        self.val_loss = record.get("val_loss", self.val_loss)
        if not self.enabled:
            return
        step = record["step"]
        if self._terminal:
            if self._bar is None:
                self._bar = self._terminal_bar()
            self._bar.set_postfix_str(step_text(record, self.val_loss), refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.every and step not in (self.first, self.total):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / (step - self.first + 1) * (self.total - step)
        self._print(f"step {step:>{len(str(self.total))}}/{self.total} | {step_text(record, self.val_loss)} | "
                    f"elapsed {clock(elapsed)} | ETA {clock(eta)}")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Clear the bar while the body writes to the terminal and redraw it after (left on its own line if the
        body raised); the body's stderr goes to the bar's stream so relayed output cannot land on the bar's line."""
        if self._bar is None:
            yield
            return
        self._bar.clear()
        self.stream.flush()  # tqdm leaves its last carriage return buffered; it must reach the terminal first
        try:
            with contextlib.redirect_stderr(self.stream):
                yield
        except BaseException:
            self.close()
            raise
        self._bar.refresh()

    def message(self, text: str) -> None:
        """Print a line of its own (the bar, if any, is redrawn below it)."""
        with self.paused():
            self._print(text)

    def close(self) -> None:
        """End the bar's line, so what follows starts on a fresh one."""
        if self._bar is not None:
            self._bar.close()
        self._bar, self._terminal = None, False

    def _print(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()
