"""The planner against measurement: memory per rank and step time that :mod:`trainmesh.plan` predicts for a
layout, next to what a real run of that layout measures here (``make bench-plan``; tolerances asserted in
``tests/multirank/test_plan_validation.py``). The quantities, tolerances and what the measured peak leaves
out: docs/performance.md."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

import trainmesh as tm
from trainmesh import api
from trainmesh.layout import Layout
from trainmesh.tracking.metrics import SavedActivations, per_rank_stats, storage_bytes
from trainmesh.training.optim import LRSchedule
from trainmesh.plan import (
    activation_bytes,
    choose,
    local_cluster,
    memory_per_rank,
    micro_batch_activation_bytes,
    model_state_bytes,
    search,
    step_time,
)
from trainmesh.distributed.testing import run_ranks
from trainmesh_bench.common import Bench, Setup, alternating_times, build, init_mesh, trainmesh_step

# The layouts run at each world: DP, ZeRO-1..3, TP (with and without sequence parallelism), PP (1F1B,
# GPipe and ZB-H1), CP (ring and all-to-all), and their products. Each is Layout fields.
MATRIX: dict[int, dict[str, dict[str, object]]] = {
    2: {
        "dp2": {"dp": 2},
        "dp2-zero1": {"dp": 2, "zero": 1},
        "dp2-zero2": {"dp": 2, "zero": 2},
        "dp2-zero3": {"dp": 2, "zero": 3},
        "tp2": {"tp": 2},
        "tp2-sp": {"tp": 2, "sequence_parallel": True},
        "pp2-1f1b": {"pp": 2, "microbatches": 2},
        "pp2-gpipe": {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
        "pp2-zb": {"pp": 2, "microbatches": 4, "schedule": "zb"},
        "cp2-ring": {"cp": 2},
        "cp2-a2a": {"cp": 2, "cp_impl": "a2a"},
    },
    4: {
        "dp4": {"dp": 4},
        "dp4-zero1": {"dp": 4, "zero": 1},
        "dp4-zero2": {"dp": 4, "zero": 2},
        "dp4-zero3": {"dp": 4, "zero": 3},
        "tp4": {"tp": 4},
        "dp2-tp2": {"dp": 2, "tp": 2},
        "dp2-pp2": {"dp": 2, "pp": 2, "microbatches": 2},
        "tp2-pp2": {"tp": 2, "pp": 2, "microbatches": 2},
        "cp4-ring": {"cp": 4},
        "cp4-a2a": {"cp": 4, "cp_impl": "a2a"},
        "dp2-cp2": {"dp": 2, "cp": 2},
    },
}
PEAK_STEPS = 2
TIMED_ROUNDS, STEPS_PER_VISIT = 6, 2
"""Step times come from rounds that visit every layout of a world for ``STEPS_PER_VISIT`` steps, the order
reversed each round, not from each layout's own training run: run one after the other, layouts drifted apart
by up to 20 % on the project's 2-core machine (dp2 and dp2-zero1, the same work, at 208 and 172 ms per
step), and that drift, not the layouts, decided which was fastest."""
TOLERANCE = {"model_state": 0.05, "activation": 0.05, "peak_activation": 0.25, "peak": 0.25}


# ----------------------------------------------------------------------------------------------------------
# Measuring the peak inside a step
# ----------------------------------------------------------------------------------------------------------


class _Saved:
    """What autograd holds in place of a saved tensor while :class:`StepPeak` records: the tensor itself,
    and a note to the tracker when autograd lets go of it (after the node's backward)."""

    __slots__ = ("tensor", "storage", "tracker")

    def __init__(self, tensor: torch.Tensor, storage: int, tracker: "StepPeak") -> None:
        self.tensor, self.storage, self.tracker = tensor, storage, tracker

    def __del__(self) -> None:
        self.tracker._released(self.storage)


class StepPeak:
    """The most memory a rank holds at once while recording: saved activations alive (``saved``), and
    those plus the model state and the tensors :meth:`holding` names held at that moment (``total``).
    Saved tensors count by storage, once, until their last backward; parameters count as model state."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]], state: Callable[[], int]) -> None:
        self._params, self._state = params, state
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = self.held = self.saved = self.total = 0

    @classmethod
    def of(cls, model: api.ParallelModel) -> "StepPeak":
        """A tracker of ``model``'s saved activations and its engine's model state."""
        return cls(model.module.parameters, lambda: storage_bytes(model.engine.state_tensors()))

    def sample(self) -> None:
        self.saved = max(self.saved, self.live)
        self.total = max(self.total, self._state() + self.live + self.held)

    def _pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not storage.nbytes() or key in {p.untyped_storage().data_ptr() for p in self._params()}:
            return t
        if key not in self._refs:
            self._refs[key], self._sizes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
        self._refs[key] += 1
        self.sample()
        return _Saved(t.detach(), key, self)  # no grad_fn: a saved output would hold its own node alive

    def _released(self, key: int) -> None:
        self.sample()
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def recording(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextlib.contextmanager
    def holding(self, t: torch.Tensor) -> Iterator[None]:
        """Count ``t`` in ``total`` (not in ``saved``) while inside, unless it is saved already: the logits
        while the loss runs, which the caller holds though autograd does not save them."""
        storage = t.untyped_storage()
        extra = 0 if storage.data_ptr() in self._refs else storage.nbytes()
        self.held += extra
        self.sample()
        try:
            yield
        finally:
            self.sample()
            self.held -= extra


def step_peak(bench: Bench, first_step: int, steps: int = PEAK_STEPS) -> StepPeak:
    """Run ``steps`` more optimizer steps of ``bench`` from ``first_step`` under a :class:`StepPeak`, which
    also counts the logits the loss receives while it runs. Forward and backward run apart from the optimizer
    step (:func:`trainmesh.api.forward_backward`) so that the peak is sampled between them, at ``trainmesh
    train``'s learning rate of each step."""
    model, cfg = bench.model, bench.cfg
    peak = StepPeak.of(model)
    schedule = LRSchedule(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with peak.holding(logits):
            return model.criterion(logits, targets)

    with peak.recording():
        for step in range(first_step, first_step + steps):
            api.forward_backward(model.module, model.engine, model.pipeline, bench.micro_batches(step), criterion)
            peak.sample()
            model.engine.step(schedule.at(step), cfg.grad_clip)
            peak.sample()
    return peak


def train(cfg: Setup) -> tuple[Bench, dict[str, list[int]]]:
    """``cfg.steps`` steps of ``cfg`` as ``trainmesh train`` takes them (its learning rate and clipping), and
    what its ``summary.json`` records of every rank: peak RSS, the model state held after the last step and
    the activation bytes the first micro-batch of the first step saved."""
    bench = build(cfg, init_mesh(cfg))
    schedule = LRSchedule(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    saved = SavedActivations(bench.model.module.parameters())
    for step in range(cfg.steps):
        bench.opt.lr = schedule.at(step)
        tm.train_step(bench.model, bench.opt, bench.batch(step), max_norm=cfg.grad_clip, dp_sliced=True,
                      saved=saved if step == 0 else None)
    return bench, per_rank_stats(bench.model.engine.state_tensors(), bench.mesh.device, saved.bytes)


def measure_rank(cfgs: list[Setup], timed_rounds: int) -> list[dict[str, object]]:
    """Runs on every rank: train each setup, then measure its step peak; rank 0 adds the run's per-rank
    figures. Then every layout's step times over ``timed_rounds`` rounds that visit each layout in turn
    (:func:`~trainmesh_bench.common.alternating_times`)."""
    torch.set_num_threads(1)
    out, benches = [], []
    for cfg in cfgs:
        bench, summary = train(cfg)
        peak = step_peak(bench, cfg.steps)
        out.append({"peak_activation_bytes": peak.saved, "peak_bytes": peak.total,
                    "summary": summary if dist.get_rank() == 0 else None})
        benches.append(bench)
    first = max(cfg.steps for cfg in cfgs) + PEAK_STEPS
    times = alternating_times([trainmesh_step(bench) for bench in benches], first, timed_rounds, STEPS_PER_VISIT,
                              benches[0].mesh.device)
    for row, layout_times in zip(out, times):
        row["step_times"] = layout_times
    return out


# ----------------------------------------------------------------------------------------------------------
# Predicted against measured
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """One pipeline stage of one layout: predicted and measured bytes per rank of each quantity."""

    layout: str
    world: int
    stage: int
    predicted: dict[str, int]
    measured: dict[str, int]
    max_rss_bytes: int
    predicted_step_s: float = 0.0
    step_times: tuple[float, ...] = ()
    tokens_per_step: int = 0

    @property
    def measured_step_s(self) -> float:
        return statistics.median(self.step_times)

    def error(self, quantity: str) -> float:
        """predicted / measured - 1."""
        return self.predicted[quantity] / self.measured[quantity] - 1

    def failures(self) -> list[str]:
        """The quantities outside :data:`TOLERANCE`, each with its figures."""
        return [f"{self.layout} stage {self.stage} {q}: predicted {self.predicted[q]:,} vs measured "
                f"{self.measured[q]:,} ({self.error(q):+.1%}, tolerance {tol:.0%})"
                for q, tol in TOLERANCE.items() if abs(self.error(q)) > tol]


def planned(layout: Layout) -> Layout:
    """``layout`` as the planner prices it: without a pipeline the schedule means nothing and is taken as 1F1B."""
    return layout if layout.pp > 1 else dataclasses.replace(layout, schedule="1f1b", virtual_stages=1)


def predicted(cfg: Setup, stage: int) -> dict[str, int]:
    """What the planner says one rank of ``stage`` holds under ``cfg``."""
    work, layout = cfg.workload, planned(cfg.layout)
    return {"model_state": model_state_bytes(work, layout, stage),
            "activation": micro_batch_activation_bytes(work, layout, stage),
            "peak_activation": activation_bytes(work, layout, stage),
            "peak": memory_per_rank(work, layout, stage).total}


def compare(name: str, cfg: Setup, per_rank: list[dict[str, object]]) -> list[Comparison]:
    """One :class:`Comparison` per pipeline stage from every rank's :func:`measure_rank` result for ``cfg``."""
    summary = per_rank[0]["summary"]
    ranks_per_stage = cfg.dp * cfg.cp * cfg.tp
    rows = []
    for stage in range(cfg.pp):
        ranks = range(stage * ranks_per_stage, (stage + 1) * ranks_per_stage)
        measured = {"model_state": max(summary["model_state_bytes"][r] for r in ranks),
                    "activation": max(summary["activation_bytes"][r] for r in ranks),
                    "peak_activation": max(per_rank[r]["peak_activation_bytes"] for r in ranks),
                    "peak": max(per_rank[r]["peak_bytes"] for r in ranks)}
        rows.append(Comparison(name, cfg.world, stage, predicted(cfg, stage), measured,
                               max(summary["max_rss_bytes"][r] for r in ranks), predicted_step(cfg),
                               tuple(per_rank[0]["step_times"]), cfg.global_batch * cfg.workload.seq_len))
    return rows


def predicted_step(cfg: Setup) -> float:
    """Seconds per step the planner predicts for ``cfg`` on this machine, as ``--plan auto`` sees it."""
    return step_time(cfg.workload, planned(cfg.layout), local_cluster(cfg.world)).total


def _setup(model: str, layout: Layout, global_batch: int, steps: int) -> Setup:
    return Setup(model, layout, global_batch, steps=steps, warmup_steps=1)


def auto_layout(model: str, world: int, global_batch: int) -> Layout:
    """The layout ``--plan auto`` runs at ``world``: the planner's choice (:func:`~trainmesh.plan.choose`) of the
    layouts that fit this machine (:func:`~trainmesh.plan.search` keeps only those the layout's rules accept)."""
    return choose(search(_setup(model, Layout(), global_batch, 1).workload, local_cluster(world))).layout


def matrix_configs(model: str, world: int, names: Iterable[str] | None = None, global_batch: int = 8,
                   steps: int = 2, auto: bool = False) -> dict[str, Setup]:
    """The :data:`MATRIX` layouts of ``world`` (or those named) as setups, with the layout ``--plan auto``
    picks as ``auto`` when ``auto`` and it is none of them."""
    layouts = MATRIX[world]
    chosen = list(layouts) if names is None else list(names)
    cfgs = {name: _setup(model, Layout(**layouts[name]), global_batch, steps) for name in chosen}
    if auto and not auto_choice(cfgs.values(), model, world, global_batch):
        cfgs["auto"] = _setup(model, auto_layout(model, world, global_batch), global_batch, steps)
    return cfgs


def auto_choice(cfgs: Iterable[Setup], model: str, world: int, global_batch: int) -> Setup | None:
    """The setup among ``cfgs`` running the layout ``--plan auto`` picks at ``world``, if any."""
    chosen = planned(auto_layout(model, world, global_batch))
    return next((c for c in cfgs if planned(c.layout) == chosen), None)


def run_matrix(model: str, world: int, names: Iterable[str] | None = None, global_batch: int = 8,
               timeout: float = 600.0, steps: int = 2, auto: bool = False,
               timed_rounds: int = TIMED_ROUNDS) -> list[Comparison]:
    """Run the layouts of ``world`` in one :func:`~trainmesh.distributed.testing.run_ranks` call and compare each."""
    cfgs = matrix_configs(model, world, names, global_batch, steps, auto)
    results = run_ranks(measure_rank, world, list(cfgs.values()), timed_rounds, timeout=timeout)
    return [row for k, (name, cfg) in enumerate(cfgs.items())
            for row in compare(name, cfg, [rank[k] for rank in results])]


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------


def _cell(row: Comparison, quantity: str) -> str:
    mib = 2**20
    return (f"{row.predicted[quantity] / mib:8.3f} {row.measured[quantity] / mib:8.3f} "
            f"{row.error(quantity):+6.1%}")


def format_table(rows: list[Comparison]) -> str:
    """Predicted vs measured MiB per rank and the relative error of each quantity, one line per stage."""
    groups = [f"{q} (±{tol:.0%})" for q, tol in TOLERANCE.items()]
    head1 = f"{'':<10} {'':>5} {'':>5}  " + "  ".join(f"{g:^24}" for g in groups) + "  max RSS"
    head2 = (f"{'layout':<10} {'world':>5} {'stage':>5}  "
             + "  ".join(f"{'pred':>8} {'meas':>8} {'err':>6}" for _ in groups) + "      MiB")
    lines = [head1, head2]
    for row in rows:
        cells = "  ".join(_cell(row, q) for q in TOLERANCE)
        lines.append(f"{row.layout:<10} {row.world:>5} {row.stage:>5}  {cells}  {row.max_rss_bytes / 2**20:7.0f}")
    return "\n".join(lines)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank): 1 when both order the layouts alike."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / norm if norm else 1.0


def format_step_table(rows: list[Comparison], auto: dict[int, str]) -> str:
    """Predicted vs measured ms per step of each layout, its measured tokens/s, the rank correlation per
    world, and where ``--plan auto``'s choice (``auto``: world -> layout name) lands among them."""
    lines = [f"{'layout':<10} {'world':>5}  {'pred ms':>8}  {'meas ms median (min-max)':>26}  {'tokens/s':>9}"]
    for world in sorted({r.world for r in rows}):
        mine = [r for r in rows if r.world == world and r.stage == 0]
        for r in mine:
            spread = f"{r.measured_step_s * 1e3:.0f} ({min(r.step_times) * 1e3:.0f}-{max(r.step_times) * 1e3:.0f})"
            lines.append(f"{r.layout:<10} {world:>5}  {r.predicted_step_s * 1e3:8.0f}  {spread:>26}  "
                         f"{r.tokens_per_step / r.measured_step_s:9,.0f}")
        rho = spearman([r.predicted_step_s for r in mine], [r.measured_step_s for r in mine])
        lines.append(f"world {world}: Spearman rank correlation of predicted and measured step time {rho:+.2f}")
        if world in auto:
            fastest = min(mine, key=lambda r: r.measured_step_s)
            chosen = next(r for r in mine if r.layout == auto[world])
            ratio = fastest.measured_step_s / chosen.measured_step_s
            lines.append(f"world {world}: --plan auto runs {auto[world]}: {ratio:.1%} of the fastest measured "
                         f"tokens/s ({fastest.layout})")
    return "\n".join(lines)


def _rows_json(rows: list[Comparison]) -> str:
    return json.dumps([dataclasses.asdict(r) | {"error": {q: r.error(q) for q in TOLERANCE}} for r in rows], indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainmesh_bench.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="model preset (default: small)")
    parser.add_argument("--world", type=int, nargs="+", choices=sorted(MATRIX), default=sorted(MATRIX))
    parser.add_argument("--layouts", nargs="+", help="only these layouts of the matrix")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each layout's training run, "
                        "before its memory is measured and its steps timed")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per world")
    parser.add_argument("--json", action="store_true", help="print the comparisons as JSON")
    args = parser.parse_args(argv)
    rows, auto = [], {}
    for world in args.world:
        names = [n for n in MATRIX[world] if args.layouts is None or n in args.layouts]
        if not names:
            continue
        cfgs = matrix_configs(args.model, world, names, args.global_batch, args.steps, auto=True)
        chosen = auto_choice(cfgs.values(), args.model, world, args.global_batch)
        auto[world] = next(name for name, cfg in cfgs.items() if cfg is chosen)
        rows += run_matrix(args.model, world, names, args.global_batch, args.timeout, args.steps, True)
    if args.json:
        print(_rows_json(rows))
        return 0
    print(f"bench plan: model={args.model} global_batch={args.global_batch} fp32, predicted vs measured MiB "
          f"per rank (worst rank of each pipeline stage)")
    print(format_table(rows))
    failed = [f for row in rows for f in row.failures()]
    print("\n".join(["outside tolerance:", *failed]) if failed else "all within tolerance")
    print(f"\nstep time: predicted (trainmesh.plan.step_time on local_cluster) vs measured (rank 0, "
          f"{TIMED_ROUNDS} rounds of {STEPS_PER_VISIT} steps over every layout)")
    print(format_step_table(rows, auto))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
