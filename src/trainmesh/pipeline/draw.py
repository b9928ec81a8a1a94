"""Ranks × time picture of a pipeline :class:`~trainmesh.pipeline.simulate.Timeline`, simulated or
measured, and the ``trainmesh schedule`` command that prints and draws a schedule."""

from __future__ import annotations

from pathlib import Path

from trainmesh.pipeline.schedules import ActionKind, build_schedule, hoist_receives
from trainmesh.pipeline.simulate import Costs, Timeline, TimelineRecord, simulate

COLOURS = {ActionKind.F: "#4c72b0", ActionKind.B: "#dd8452", ActionKind.BI: "#c44e52", ActionKind.BW: "#55a868"}
LABELS = {ActionKind.F: "F forward", ActionKind.B: "B backward", ActionKind.BI: "BI backward (input)",
          ActionKind.BW: "BW backward (weights)"}


def _matplotlib() -> tuple[type, type, type]:
    """Figure, Agg canvas and Patch classes; no pyplot, so drawing never touches the user's backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("drawing a pipeline timeline needs matplotlib: pip install 'trainmesh[viz]'") from error
    return Figure, FigureCanvasAgg, Patch


def _shade(record: TimelineRecord, n_ranks: int, n_chunks: int) -> float:
    """Opacity per model chunk, so the chunks of an interleaved schedule tell apart."""
    chunk = record.action.stage // n_ranks
    return 1.0 if n_chunks == 1 else 1.0 - 0.55 * chunk / (n_chunks - 1)


def draw_timeline(timeline: Timeline, path_png: str | Path, title: str | None = None) -> Path:
    """Draw one box per compute action (colour = kind, number = microbatch) and save a PNG titled with the
    bubble fraction. Comm actions leave gaps (the bubbles); times start at 0."""
    figure_class, canvas_class, patch_class = _matplotlib()
    compute = [r for r in timeline.records if r.action.is_compute]
    if not compute:
        raise ValueError("the timeline has no compute actions (F/B/BI/BW) to draw")
    origin = min(r.start for r in timeline.records)
    n_chunks = max(r.action.stage for r in compute) // timeline.n_ranks + 1
    most_per_rank = max(sum(r.rank == rank for r in compute) for rank in range(timeline.n_ranks))
    height = 1.4 + 0.5 * timeline.n_ranks
    figure = figure_class(figsize=(min(max(6.0, 0.3 * most_per_rank), 40.0), height))
    canvas_class(figure)
    axes = figure.add_subplot()
    for record in compute:
        left = record.start - origin
        axes.barh(record.rank, record.duration, left=left, height=0.8, color=COLOURS[record.action.kind],
                  alpha=_shade(record, timeline.n_ranks, n_chunks), edgecolor="black", linewidth=0.4)
        label = str(record.action.microbatch)
        axes.text(left + record.duration / 2, record.rank, label, ha="center", va="center", fontsize=7)
    kinds = [kind for kind in COLOURS if any(r.action.kind is kind for r in compute)]
    figure.legend(handles=[patch_class(color=COLOURS[kind], label=LABELS[kind]) for kind in kinds], loc="lower center",
                  ncol=len(kinds), fontsize=8, frameon=False)
    axes.set_yticks(range(timeline.n_ranks), [f"rank {rank}" for rank in range(timeline.n_ranks)])
    axes.set_ylim(timeline.n_ranks - 0.5, -0.5)
    axes.set_xlim(0, timeline.makespan)
    axes.set_xlabel("time")
    axes.set_title(f"{title or 'pipeline timeline'}: bubble {timeline.bubble_fraction:.1%}")
    figure.tight_layout(rect=(0, 0.3 / height, 1, 1))  # leave the bottom 0.3 inch to the legend
    path = Path(path_png)
    figure.savefig(path, format="png", dpi=110)
    return path


def schedule_command(pp: int, microbatches: int, schedule: str, virtual: int, png: str | None,
                     costs: str | None = None) -> str:
    """Text for ``trainmesh schedule``: each rank's compute order, busy/idle, peak activations, simulated with
    F=1, B=2 and free communication (the textbook setting) or with a run's measured ``costs``; draws the
    timeline to ``png`` when given."""
    actions = [hoist_receives(a) for a in build_schedule(schedule, pp, microbatches, virtual)]  # as the runtime runs them
    timeline = simulate(actions, Costs() if costs is None else Costs.load(costs))
    unit = "" if costs is None else " s"
    setting = ("F=1, B=2, BI=BW=1 per stage, or per chunk when interleaved; comm free" if costs is None
               else f"measured costs from {costs}")
    lines = [f"schedule {schedule!r}: pp={pp}, microbatches={microbatches}, virtual={virtual} ({setting})",
             "peak act: most microbatches (per chunk when interleaved) whose activations a rank holds at once",
             f"{'rank':>4}  {'busy':>8}  {'idle':>8}  {'peak act':>8}  compute order (send/recv omitted)"]
    for rank, (busy, peak) in enumerate(zip(timeline.busy_times, timeline.peak_activations, strict=True)):
        order = " ".join(str(a) for a in actions[rank] if a.is_compute)
        lines.append(f"{rank:>4}  {busy:>8.4g}  {timeline.makespan - busy:>8.4g}  {peak:>8}  {order}")
    lines.append(f"makespan {timeline.makespan:.4g}{unit}, bubble fraction {timeline.bubble_fraction:.4f}")
    if png is not None:
        path = draw_timeline(timeline, png, title=f"{schedule} pp={pp} m={microbatches} v={virtual}")
        lines.append(f"timeline drawn to {path}")
    return "\n".join(lines)
