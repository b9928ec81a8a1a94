"""``trainmesh report RUN_DIR``: one picture and a few lines of text from a run's ``metrics.jsonl`` (loss, speed,
memory, communication, expert load), for finished, crashed or live runs; several runs are overlaid and tabled by
the settings in which they differ."""

from __future__ import annotations

import io
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

from trainmesh.storage.safe_io import UnreadableFile, read_user_file, replace_durably
from trainmesh.tracking.records import METRICS_FILE, REPORT_FILE, SUMMARY_FILE, LossWindows
MEMORY_KINDS = {"max_rss_bytes": "peak RSS", "peak_device_bytes": "peak device memory",
                "model_state_bytes": "model state", "activation_bytes": "activations (1 micro-batch)"}
TRAIN_COLOUR, EVAL_COLOUR, MFU_COLOUR = "#4c72b0", "#dd8452", "#55a868"


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message says why."""


@dataclass
class History:
    """The series a report draws, gathered from a run's records (one per step)."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # tokens trained on by the end of each step, where counted
    mfu: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    memory: dict[str, list[int]] = field(default_factory=dict)  # kind -> per-rank peak over the run
    comm: dict[str, dict[str, float]] = field(default_factory=dict)  # axis -> op -> mean bytes per step
    restarts: list[int] = field(default_factory=list)  # the checkpoint step each restart resumed from
    moe_steps: list[int] = field(default_factory=list)
    expert_tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # MoE layer -> per step, per expert
    balance: dict[str, list[float]] = field(default_factory=dict)  # MoE layer -> max/mean load per step
    dropped: list[float] = field(default_factory=list)  # fraction of token copies dropped per step, all layers
    straggled: dict[int, int] = field(default_factory=dict)  # rank -> steps on which it was named a straggler
    split: dict[str, list[float]] = field(default_factory=dict)  # compute_s / wait_s -> per-rank sum over the run

    @classmethod
    def of(cls, records: Sequence[dict[str, Any]]) -> "History":
        h = cls()
        comm_totals: dict[str, dict[str, float]] = {}
        for r in records:
            h.steps.append(r["step"])
            h.loss.append(r["loss"])
            h.tokens_per_s.append(r.get("tokens_per_s") or 0.0)  # a script's RunLog.log may not count tokens
            if r.get("tokens_per_s") and _is_number(r.get("step_time_s")):
                h.tokens.append((h.tokens[-1] if h.tokens else 0.0) + r["tokens_per_s"] * r["step_time_s"])
            if r.get("mfu") is not None:
                h.mfu.append(r["mfu"])
            if r.get("val_loss") is not None:
                h.eval_steps.append(r["step"])
                h.eval_loss.append(r["val_loss"])
            if "restart" in r:
                h.restarts.append(r["restart"]["from_step"])
            if r.get("moe"):
                h._add_experts(r["step"], r["moe"])
            for rank in r.get("stragglers") or []:
                h.straggled[rank] = h.straggled.get(rank, 0) + 1
            for key in ("compute_s", "wait_s"):  # a world that shrank leaves its missing ranks at their sums
                h.split[key] = [a + b for a, b in zip_longest(h.split.get(key, []), r.get(key) or [], fillvalue=0.0)]
            for kind in MEMORY_KINDS:  # a run resumed at another world size has more or fewer ranks
                h.memory[kind] = [max(a, b) for a, b in zip_longest(h.memory.get(kind, []), r.get(kind) or [],
                                                                    fillvalue=0)]
            for key, n in r.get("comm_bytes_by_op", {}).items():
                axis, _, op = key.partition("/")
                ops = comm_totals.setdefault(axis, {})
                ops[op] = ops.get(op, 0.0) + n
        h.memory = {kind: peaks for kind, peaks in h.memory.items() if any(peaks)}
        h.comm = {axis: {op: n / len(records) for op, n in sorted(ops.items())} for axis, ops in sorted(comm_totals.items())}
        return h

    def _add_experts(self, step: int, layers: dict[str, dict[str, Any]]) -> None:
        self.moe_steps.append(step)
        for name, layer in layers.items():
            self.expert_tokens.setdefault(name, []).append(layer["expert_tokens"])
            self.balance.setdefault(name, []).append(layer["balance"])
        self.dropped.append(statistics.mean(layer["dropped_fraction"] for layer in layers.values()))

    @property
    def steady_tokens_per_s(self) -> float:
        """Median tokens/s without the first step, which pays for warm-up (allocation, compilation)."""
        return statistics.median(self.tokens_per_s[1:] or self.tokens_per_s)


METRICS_LIMIT = 1 << 30  # a million steps of records with every field; more is not a metrics file
SUMMARY_LIMIT = 1 << 20
NUMBERS = ("loss", "tokens_per_s", "mfu", "val_loss")  # loss required, the others may be absent or null


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record_problem(r: dict[str, Any]) -> str | None:
    """What in a step record the report could not draw (a field of the wrong type), or None."""
    for key in NUMBERS:
        if (key == "loss" or r.get(key) is not None) and not _is_number(r.get(key)):
            return f"{key} is {json.dumps(r.get(key))[:40]}, not a number"
    for kind in MEMORY_KINDS:
        peaks = r.get(kind)
        if peaks is not None and not (isinstance(peaks, list) and all(_is_number(n) for n in peaks)):
            return f"{kind} is not a list of byte counts"
    by_op = r.get("comm_bytes_by_op", {})
    if not (isinstance(by_op, dict) and all(_is_number(n) for n in by_op.values())):
        return "comm_bytes_by_op is not a map of byte counts"
    if "restart" in r and not (isinstance(r["restart"], dict) and isinstance(r["restart"].get("from_step"), int)):
        return "restart has no from_step"
    moe = r.get("moe")
    if moe and not (isinstance(moe, dict) and all(
            isinstance(layer, dict) and isinstance(layer.get("expert_tokens"), list)
            and all(_is_number(n) for n in layer["expert_tokens"])
            and _is_number(layer.get("balance")) and _is_number(layer.get("dropped_fraction"))
            for layer in moe.values())):
        return "moe is not a map of layers with expert_tokens, balance and dropped_fraction"
    return None


def _metrics_text(path: Path) -> str:
    """``metrics.jsonl`` as text: a regular file (a FIFO would block the report for ever), bounded, UTF-8."""
    if not path.exists():
        raise ReportError(f"{path.parent} has no {METRICS_FILE}; give the run directory a training run wrote "
                          f"(--out, default runs/<timestamp>)")
    try:
        data = read_user_file(path, METRICS_LIMIT)
    except UnreadableFile as e:
        raise ReportError(f"{e}; give the run directory a training run wrote (--out, default runs/<timestamp>)") \
            from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"{path} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start}); "
                          f"it is not a metrics file a training run wrote") from None


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The whole records of ``run_dir/metrics.jsonl``, in step order; a torn line (a killed run) is skipped,
    and a record whose fields have the wrong types (an edited file) is one line naming it."""
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; give the run directory a training run wrote (--out)")
    records = []
    for number, line in enumerate(_metrics_text(path).splitlines(), 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "loss" in record:
            if problem := _record_problem(record):
                raise ReportError(f"{path} line {number}: {problem}; the file was edited or is not one a "
                                  f"training run wrote")
            records.append(record)
    if not records:
        raise ReportError(f"{path} holds no step records yet; wait for the run's first step")
    return sorted(records, key=lambda r: r["step"])


def _unit(n: float) -> tuple[float, str]:
    """The binary unit that shows ``n`` bytes with one to four digits before the point."""
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "B"


def _bytes(n: float) -> str:
    scale, name = _unit(n)
    return f"{n / scale:.1f} {name}" if scale > 1 else f"{n:.0f} B"


def summary_text(h: History, run_dir: Path) -> str:
    """What the figure shows, as lines to read in a terminal."""
    windows = LossWindows.of(h.loss)
    lines = [f"{run_dir}: steps {h.steps[0]}-{h.steps[-1]} ({len(h.steps)} records)", f"  {windows.text()}"]
    if h.eval_loss:
        best = min(range(len(h.eval_loss)), key=h.eval_loss.__getitem__)
        lines.append(f"  eval loss {h.eval_loss[-1]:.4f} at step {h.eval_steps[-1]} "
                     f"(best {h.eval_loss[best]:.4f} at step {h.eval_steps[best]})")
    mfu = f", MFU {statistics.median(h.mfu):.1%}" if h.mfu else ""
    lines.append(f"  throughput {h.steady_tokens_per_s:,.0f} tok/s (median, first step left out){mfu}")
    for kind, peaks in h.memory.items():
        lines.append(f"  {MEMORY_KINDS[kind]} per rank: " + ", ".join(_bytes(n) for n in peaks))
    for axis, ops in h.comm.items():
        detail = ", ".join(f"{op} {_bytes(n)}" for op, n in ops.items())
        lines.append(f"  {axis} sends {_bytes(sum(ops.values()))} per rank per step ({detail})")
    if not h.comm:
        lines.append("  no communication (one rank)")
    if len(h.split.get("compute_s", [])) > 1:  # one rank waits for nobody
        lines.append("  per rank, seconds computing / waiting for peers over the run: " + ", ".join(
            f"{c:.1f}/{w:.1f}" for c, w in zip(h.split["compute_s"], h.split["wait_s"])))
    if h.straggled:
        lines.append("  stragglers named (computing slower than the median rank): " + ", ".join(
            f"rank {rank} on {n} step(s)" for rank, n in sorted(h.straggled.items())))
    if h.restarts:
        lines.append("  resumed from the checkpoint of step " + ", ".join(map(str, h.restarts)))
    if h.balance:
        loads = ", ".join(f"{name} {b[-1]:.2f}" for name, b in h.balance.items())
        lines.append(f"  expert load max/mean at step {h.moe_steps[-1]}: {loads}; {h.dropped[-1]:.1%} of token copies "
                     f"dropped")
    return "\n".join(lines)


def _moving_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start), to see a trend through step noise."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _draw_loss(ax: Any, h: History) -> None:
    window = max(1, len(h.loss) // 20)
    ax.plot(h.steps, h.loss, color=TRAIN_COLOUR, alpha=0.3, linewidth=1)
    ax.plot(h.steps, _moving_mean(h.loss, window), color=TRAIN_COLOUR, linewidth=2,
            label="train" if window == 1 else f"train (mean of {window} steps)")
    if h.eval_loss:
        ax.plot(h.eval_steps, h.eval_loss, "o-", color=EVAL_COLOUR, linewidth=2, label="eval")
    for step in h.restarts:
        ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    ax.set(title="loss", xlabel="step", ylabel="cross-entropy")
    ax.legend(frameon=False)


def _draw_throughput(ax: Any, h: History) -> None:
    window = max(1, len(h.tokens_per_s) // 20)
    ax.plot(h.steps, h.tokens_per_s, color=TRAIN_COLOUR, alpha=0.3, linewidth=1)
    ax.plot(h.steps, _moving_mean(h.tokens_per_s, window), color=TRAIN_COLOUR, linewidth=2)
    ax.set(title=f"throughput: {h.steady_tokens_per_s:,.0f} tokens/s (median)", xlabel="step", ylabel="tokens/s")
    ax.set_ylim(bottom=0, top=1.15 * max(h.tokens_per_s[1:] or h.tokens_per_s) or 1.0)
    ax.yaxis.set_major_formatter("{x:,.0f}")
    if h.mfu:
        mfu_ax = ax.twinx()
        mfu_ax.plot(h.steps[-len(h.mfu):], [100 * m for m in h.mfu], color=MFU_COLOUR, linewidth=1)
        mfu_ax.set_ylabel("MFU %", color=MFU_COLOUR)
        mfu_ax.set_ylim(bottom=0)


def _draw_memory(ax: Any, h: History) -> None:
    """Grouped bars on a log scale: a process's RSS can be a hundred times its model state, and both matter."""
    ax.set_title("peak memory per rank")
    if not h.memory:
        ax.text(0.5, 0.5, "no memory recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    ranks = max((len(p) for p in h.memory.values()), default=0)
    scale, unit = _unit(max((max(p) for p in h.memory.values()), default=0))
    width = 0.8 / max(1, len(h.memory))
    for k, (kind, peaks) in enumerate(h.memory.items()):
        xs = [r + (k - (len(h.memory) - 1) / 2) * width for r in range(len(peaks))]
        bars = ax.bar(xs, [n / scale for n in peaks], width, label=MEMORY_KINDS[kind])
        if ranks <= 8:
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
    ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_yscale("log")
    ax.set(ylabel=f"{unit} (log scale)")
    ax.set_ylim(top=ax.get_ylim()[1] * 30)  # room for the labels and the legend above the tallest bar
    ax.legend(frameon=False, fontsize=8, loc="upper center", ncols=2)


def _draw_comm(ax: Any, h: History) -> None:
    ax.set_title("communication per rank per step, by mesh axis")
    if not h.comm:
        ax.text(0.5, 0.5, "no communication (one rank)", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    scale, unit = _unit(max(sum(ops.values()) for ops in h.comm.values()))
    axes = list(h.comm)
    left = [0.0] * len(axes)
    for op in sorted({op for ops in h.comm.values() for op in ops}):
        widths = [h.comm[axis].get(op, 0.0) / scale for axis in axes]
        ax.barh(axes, widths, height=0.5, left=left, label=op)
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.2f} {unit}", va="center", fontsize=8)
    ax.set_xlim(right=1.25 * max(left))
    ax.set_ylim(-1, len(axes))
    ax.set(xlabel=f"{unit} sent per rank per step (ring volumes)")
    ax.legend(frameon=False, fontsize=8, loc="lower right")


def _draw_expert_load(ax: Any, h: History) -> None:
    """Each expert's share of its layer's token copies over the steps, layers stacked (one row per expert):
    a collapsed router shows as one bright row per layer, a balanced one as an even field at 1/E."""
    rows, labels = [], []
    for name, per_step in h.expert_tokens.items():
        for e in range(len(per_step[0])):
            rows.append([counts[e] / max(1, sum(counts)) for counts in per_step])
            labels.append(f"{name} e{e}" if e == 0 else f"e{e}")
    image = ax.imshow(rows, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0,
                      extent=(h.moe_steps[0] - 0.5, h.moe_steps[-1] + 0.5, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), labels, fontsize=6 if len(rows) > 16 else 8)
    ax.set(title="expert load: share of each layer's token copies", xlabel="step")
    ax.figure.colorbar(image, ax=ax, fraction=0.04)


def _draw_balance(ax: Any, h: History) -> None:
    for name, values in h.balance.items():
        ax.plot(h.moe_steps, values, linewidth=1.5, label=name)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set(title=f"expert balance; {h.dropped[-1]:.1%} dropped at the last step", xlabel="step",
           ylabel="max / mean tokens per expert")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False, fontsize=8)


def draw_report(h: History, path: Path, title: str) -> Path:
    """Draw the four panels (loss, throughput, memory, communication), and for a mixture of experts the
    expert load and balance, into one PNG at ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("trainmesh report draws with matplotlib: pip install 'trainmesh[watch]'") from None
    experts = bool(h.expert_tokens)
    figure = Figure(figsize=(13, 12.5 if experts else 8.5), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(3 if experts else 2, 2)
    (loss, speed), (memory, comm) = panels[:2]
    if experts:
        _draw_expert_load(panels[2][0], h)
        _draw_balance(panels[2][1], h)
    _draw_loss(loss, h)
    _draw_throughput(speed, h)
    _draw_memory(memory, h)
    _draw_comm(comm, h)
    figure.suptitle(title)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    replace_durably(path, png.getvalue())  # a link planted at ``path`` is replaced, never written through
    return path


def _summary(run_dir: Path) -> dict[str, Any]:
    """The run's ``summary.json`` (written at the end), or {} when there is none or it cannot be read."""
    try:
        summary = json.loads(read_user_file(run_dir / SUMMARY_FILE, SUMMARY_LIMIT))
    except (OSError, ValueError, RecursionError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _title(run_dir: Path, h: History) -> str:
    """The run directory, and the model and layout if ``summary.json`` (written at the end) says them."""
    try:
        summary = _summary(run_dir)
        cfg = summary["config"]
        layout = (f" — {summary.get('model') or cfg['model']}, dp={cfg['dp']} tp={cfg['tp']} pp={cfg['pp']} "
                  f"zero={cfg['zero']}")
    except (KeyError, TypeError):
        layout = ""
    return f"{run_dir.resolve().name}{layout}, steps {h.steps[0]}-{h.steps[-1]}"


def _checked_png(path: Path) -> Path:
    if path.is_symlink():
        raise ReportError(f"{path} is a symbolic link; report writes its own file there and never follows a link: "
                          f"remove it")
    return path


def report(run_dir: Path, path: Path | None = None) -> str:
    """Write ``path`` (default ``run_dir/report.png``); return the text summary and where the picture is."""
    h = History.of(read_records(run_dir))
    path = draw_report(h, _checked_png(path or run_dir / REPORT_FILE), _title(run_dir, h))
    return f"{summary_text(h, run_dir)}\n  figure: {path}"


COMPARE_FILE = "compare.png"
UNCOMPARED = frozenset({"out", "checkpoint_dir", "resume", "overwrite", "progress", "progress_every", "tensorboard",
                        "wandb", "tee", "config", "checkpoint_every", "keep_last", "checkpoint_async", "max_restarts",
                        "stopped_grace", "collective_timeout", "timeline", "profile_steps"})
"""Settings that say where a run writes or how it is watched, not what it trains: never a run's label."""


@dataclass(frozen=True)
class Run:
    """One run of a comparison: its directory, series and settings (its summary's config over its first
    record's layout, so a crashed or live run is labelled too)."""

    directory: Path
    history: History
    settings: dict[str, Any]

    @classmethod
    def read(cls, directory: Path) -> "Run":
        records = read_records(directory)
        layout = next((r["layout"] for r in records if isinstance(r.get("layout"), dict)), {})
        config = _summary(directory).get("config")
        return cls(directory, History.of(records), {**layout, **(config if isinstance(config, dict) else {})})


def differences(runs: Sequence[Run]) -> list[str]:
    """The settings every run records whose values are not the same in all, in the first run's order (a setting
    one run does not record, as a script's run records few, is unknown there rather than different)."""
    keys = [k for k in runs[0].settings if k not in UNCOMPARED and all(k in run.settings for run in runs)]
    return [k for k in keys if len({json.dumps(run.settings.get(k), sort_keys=True) for run in runs}) > 1]


def _labels(runs: Sequence[Run], keys: Sequence[str]) -> list[str]:
    """Each run's label: the settings in which the runs differ, or its directory's name if none do."""
    if not keys:
        return [run.directory.resolve().name for run in runs]
    return [" ".join(f"{k}={run.settings.get(k, '-')}" for k in keys) for run in runs]


def compare_text(runs: Sequence[Run], keys: Sequence[str]) -> str:
    """A table of the runs: the settings that differ, then the loss, eval loss, tokens/s and peak memory."""
    header = ["run", *keys, "last loss", "eval loss", "tokens/s", "peak memory"]
    rows = []
    for run in runs:
        h = run.history
        peak = max((max(p) for p in h.memory.values()), default=0)
        rows.append([str(run.directory), *(str(run.settings.get(k, "-")) for k in keys),
                     f"{LossWindows.of(h.loss).last:.4f}", f"{h.eval_loss[-1]:.4f}" if h.eval_loss else "-",
                     f"{h.steady_tokens_per_s:,.0f}", _bytes(peak) if peak else "-"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    what = ", ".join(keys) if keys else "no setting (labelled by directory)"
    return "\n".join([f"{len(runs)} runs; they differ in {what}", *lines])


def _draw_overlay(panels: Any, runs: Sequence[Run], labels: Sequence[str]) -> None:
    """Loss against step and against tokens, tokens/s against step, and each run's peak memory per rank."""
    by_step, by_tokens, speed, memory = panels
    ranks = max((len(p) for run in runs for p in run.history.memory.values()), default=0)
    width = 0.8 / len(runs)
    for i, (run, label) in enumerate(zip(runs, labels)):
        h, colour = run.history, f"C{i}"
        window = max(1, len(h.loss) // 20)
        by_step.plot(h.steps, _moving_mean(h.loss, window), color=colour, linewidth=2, label=label)
        if h.eval_loss:
            by_step.plot(h.eval_steps, h.eval_loss, "o--", color=colour, linewidth=1)
        if len(h.tokens) == len(h.loss):
            by_tokens.plot(h.tokens, _moving_mean(h.loss, window), color=colour, linewidth=2, label=label)
        speed.plot(h.steps, _moving_mean(h.tokens_per_s, window), color=colour, linewidth=2, label=label)
        kind = next((k for k in ("peak_device_bytes", "max_rss_bytes") if k in h.memory), None)
        if kind is not None:
            peaks = h.memory[kind]
            memory.bar([r + (i - (len(runs) - 1) / 2) * width for r in range(len(peaks))],
                       [n / 2**20 for n in peaks], width, color=colour, label=f"{label} ({MEMORY_KINDS[kind]})")
    by_step.set(title="loss (dashed: eval)", xlabel="step", ylabel="cross-entropy")
    by_tokens.set(title="loss against tokens trained on", xlabel="tokens", ylabel="cross-entropy")
    speed.set(title="throughput", xlabel="step", ylabel="tokens/s")
    speed.set_ylim(bottom=0)
    memory.set(title="peak memory per rank", ylabel="MiB")
    memory.set_ylim(top=memory.get_ylim()[1] * 1.3)  # room for the legend above the bars
    memory.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    for ax in panels:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(frameon=False, fontsize=8)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)


def draw_comparison(runs: Sequence[Run], labels: Sequence[str], path: Path) -> Path:
    """The runs overlaid, one colour each, in one PNG at ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("trainmesh report draws with matplotlib: pip install 'trainmesh[watch]'") from None
    figure = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(figure)
    _draw_overlay(list(figure.subplots(2, 2).flat), runs, labels)
    figure.suptitle(", ".join(run.directory.resolve().name for run in runs))
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    replace_durably(path, png.getvalue())
    return path


def compare(run_dirs: Sequence[Path], path: Path = Path(COMPARE_FILE)) -> str:
    """Overlay the runs in ``path``; return the table of how they differ and where the picture is."""
    runs = [Run.read(d) for d in run_dirs]
    keys = differences(runs)
    figure = draw_comparison(runs, _labels(runs, keys), _checked_png(path))
    return f"{compare_text(runs, keys)}\n  figure: {figure}"
