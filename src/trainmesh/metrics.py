"""Per-step metrics: the JSON lines file and the sinks fed from it, the summary, the progress line, and
memory accounting.

Steps count from 1 everywhere a person reads them: ``metrics.jsonl``, progress lines, TensorBoard and
checkpoint directories. Step N is the N-th optimizer step; its record is written once it is done, so the
record of step N and the checkpoint ``step-N`` describe the same weights, and a run resumed from
``step-N`` logs step N+1 next. (Inside the loop, data sampling and the learning-rate schedule take the
0-based index N-1.)

``model_state_bytes`` counts the bytes of parameters, gradients and optimizer state a rank actually
holds, each storage once (a gradient that is a view into a bucket counts as part of the bucket) and a
freed tensor not at all; it is the quantity the ZeRO paper's memory formulas predict.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TextIO

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
        return t.detach()  # not t: a saved output would hold its own node, and the graph with it, under retain_graph

    @contextlib.contextmanager
    def recording(self) -> Iterator["SavedActivations"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self.bytes = sum(self._seen.values())


def max_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak FLOP/s of one device from its vendor datasheet (SXM parts): 16-bit (bf16/fp16) tensor
    cores, and plain fp32 (torch leaves TF32 matmuls off by default)."""

    half: float
    fp32: float

    def at(self, precision: str) -> float:
        """The peak a run in ``precision`` can reach; 0 (unknown) for a precision not in the datasheet row."""
        return {"bf16": self.half, "fp16": self.half, "fp32": self.fp32}.get(precision, 0.0)


# The one table of device peaks: MFU divides by it and the planner's cluster presets are built from it.
# Keys are matched as substrings of torch.cuda.get_device_name(), in this order.
DEVICE_PEAKS: dict[str, DevicePeak] = {
    "H200": DevicePeak(989e12, 67e12),
    "H100": DevicePeak(989e12, 67e12),
    "A100": DevicePeak(312e12, 19.5e12),
    "L40S": DevicePeak(362e12, 91.6e12),
    "L4": DevicePeak(121e12, 30.3e12),
    "A10G": DevicePeak(70e12, 31.2e12),
}


def device_peak(device_name: str) -> DevicePeak | None:
    """The :data:`DEVICE_PEAKS` row of a device called ``device_name``; None if it is not in the table."""
    return next((peak for key, peak in DEVICE_PEAKS.items() if key in device_name), None)


def peak_tflops(device: torch.device, precision: str, override: float = 0.0) -> float:
    """The per-device peak that MFU divides by: ``override`` if given, else the table's at ``precision``;
    0 if unknown (a CPU, an unlisted GPU)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    peak = device_peak(torch.cuda.get_device_name(device))
    return peak.at(precision) / 1e12 if peak is not None else 0.0


def block_flops_per_token(d_model: int, d_ff: int, seq_len: int, gated_mlp: bool = False,
                          qkv_width: int | None = None) -> int:
    """Forward FLOPs of one transformer block per token: 2 per weight of its matmuls (4h^2 in attention,
    2hf in the MLP, 3hf when gated) and 4sh for QK^T and AV (Narayanan et al., 2021, Megatron-LM, appendix
    "FLOPs"). Biases, norms and the softmax are left out, as there. ``qkv_width`` is the q/k/v projection's
    output width, 3h unless grouped-query attention shares K/V heads (h + 2·kv_heads·head_dim)."""
    weights = ((qkv_width or 3 * d_model) + d_model) * d_model + (3 if gated_mlp else 2) * d_model * d_ff
    return 2 * weights + 4 * seq_len * d_model


def head_flops_per_token(d_model: int, vocab_size: int) -> int:
    """Forward FLOPs of the output projection per token (the V/(16lh) term of Megatron-LM's appendix)."""
    return 2 * d_model * vocab_size


def model_flops_per_token(n_layers: int, d_model: int, d_ff: int, vocab_size: int, seq_len: int,
                          gated_mlp: bool = False, qkv_width: int | None = None) -> int:
    """Training FLOPs per token that MFU counts: forward and backward (twice the forward) of every block and
    the head, without recomputation (Chowdhery et al., 2022, PaLM, appendix B: 6N + 12LHQT); embedding
    lookups are free. The planner's step FLOPs are built on the same functions."""
    forward = n_layers * block_flops_per_token(d_model, d_ff, seq_len, gated_mlp, qkv_width) + head_flops_per_token(
        d_model, vocab_size)
    return 3 * forward


def mfu(tokens_per_s: float, flops_per_token: int, world_size: int, peak: float) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (TFLOP/s) of all devices (None if unknown)."""
    return tokens_per_s * flops_per_token / (world_size * peak * 1e12) if peak > 0 else None


def peak_device_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


class MetricsError(RuntimeError):
    """A metrics file could not be written; the message names the file and the error."""


METRICS_FILE = "metrics.jsonl"


def keep_steps_through(path: Path, step: int) -> int:
    """Rewrite the metrics file ``path`` keeping only the whole records of steps up to ``step``; returns
    how many records of later steps it dropped.

    A run that crashed logged the steps after its last checkpoint, which the resumed run trains and logs
    again; keeping both would give those steps two records. A last line without its newline (a write cut
    short by the kill) is dropped too. The rewrite is atomic, so a crash during it leaves the old file.
    """
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
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
    """Somewhere besides ``metrics.jsonl`` that each step's record goes (TensorBoard, W&B)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable numbers of one ``metrics.jsonl`` record under the tags every sink uses: one chart per
    quantity, one series per rank (memory) or mesh axis (communication), and for each MoE layer its balance,
    dropped fraction, aux and z losses and each expert's token copies."""
    out = {tag: float(record[key]) for key, tag in (
        ("loss", "train/loss"), ("val_loss", "eval/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
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
    """TensorBoard event files in the run directory (``tensorboard --logdir RUN_DIR``).

    A resumed run passes ``purge_step``, the first step it logs: TensorBoard then hides the events the
    interrupted attempt wrote for that step and later, as ``metrics.jsonl`` drops their records.
    """

    FLUSH_SECS = 10  # a live dashboard lags the run by at most this

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=self.FLUSH_SECS)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run of ``project``, kept under the run directory.

    Offline unless ``WANDB_MODE`` says otherwise: a run must not stall or fail on a cluster node without
    network or credentials; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later, and
    ``WANDB_MODE=online`` (after ``wandb login``) streams it live.
    """

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, dir=str(run_dir), name=run_dir.name, config=config,
                               mode=os.environ.get("WANDB_MODE", "offline"))

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def open_sinks(run_dir: Path, tensorboard: bool, wandb_project: str, config: dict[str, Any],
               resume_from: int | None = None) -> list[Sink]:
    """The sinks a run asked for: TensorBoard if ``tensorboard`` and the package is installed (it is on by
    default, so its absence is not an error), W&B if ``wandb_project`` is given (the CLI has checked that
    ``wandb`` is installed before spawning any rank)."""
    sinks: list[Sink] = []
    if tensorboard and package_available("tensorboard"):
        sinks.append(TensorBoardSink(run_dir, None if resume_from is None else resume_from + 1))
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_dir, config))
    return sinks


class MetricsWriter:
    """Writes ``metrics.jsonl`` (one object per step) and ``summary.json``, and hands each record to its
    sinks; a no-op off rank 0.

    Each record is one ``os.write`` of a whole line to a file opened with ``O_APPEND``, never split over
    buffer flushes, so a rank killed mid-run leaves whole lines behind; a write the disk cannot take
    (``ENOSPC``) is cut back to the previous line's end and raised as :class:`MetricsError` naming the
    file, and the run stops (see ``train``).
    """

    def __init__(self, out_dir: str | None, enabled: bool, resume_from: int | None = None,
                 sinks: Sequence[Sink] = ()) -> None:
        """``resume_from``: the step a resumed or restarted run's checkpoint holds. The file is kept up to
        that step (:func:`keep_steps_through`) and the first record written (step ``resume_from + 1``)
        carries ``"restart": {"from_step": N, "replayed_steps": K}`` (K records of the earlier attempt
        dropped), so every step has exactly one record, the last run's. None starts a new file."""
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
                self._fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise MetricsError(f"opening {self.path} failed: {e.strerror or e}") from None

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        if self._restart is not None:
            record, self._restart = {**record, "restart": self._restart}, None
        line = (json.dumps(record) + "\n").encode()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            if os.write(self._fd, line) != len(line):
                raise OSError(errno.ENOSPC, f"only part of a {len(line)}-byte line was written")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise MetricsError(f"writing {self.path} failed: [Errno {e.errno}] {e.strerror}") from None
        for sink in self.sinks:
            sink.write(record)

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
        for sink in self.sinks:
            sink.close()
        self.sinks = []


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


class Progress:
    """What rank 0 prints while training: per-step progress, and messages (start, checkpoints, summary).

    On a terminal with ``tqdm`` installed the progress is one bar redrawn in place, with elapsed time and
    ETA; otherwise (a log file, a pipe, no tqdm) a plain line every ``every`` steps and at the last step.
    ``enabled=False`` (``--no-progress``) drops only the per-step output; messages always print. Anything
    else that writes to the terminal mid-run (a checkpoint notice on stderr) does so inside
    :meth:`paused`, which takes the bar off the line first and draws it again after.
    """

    def __init__(self, total: int, first: int, stream: TextIO | None, enabled: bool = True, every: int = 0) -> None:
        """``first``: the step this run starts at (later than 1 when resumed); ``stream``: where to print
        (None on every rank but 0); ``every``: steps between plain lines (0: a twentieth of the run)."""
        self.total, self.first, self.stream = total, first, stream
        self.enabled = enabled and stream is not None
        self.every = every or max(1, total // 20)
        self.start = time.perf_counter()
        self.val_loss: float | None = None
        self._bar: Any = None  # drawn at the first step, below the messages printed before it
        self._terminal = self.enabled and stream.isatty() and package_available("tqdm")

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
        """Clear the bar while the body writes to the terminal; redraw it below what was written, or, if the
        body raised, leave it drawn on a line of its own so the error that follows starts on a fresh one.

        What the body prints to stderr goes to the bar's stream meanwhile: under ``--nproc`` the launcher
        relays rank 0's stderr through a pipe, so a notice sent there would reach the terminal after the bar
        is redrawn, and land on the bar's line.
        """
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
