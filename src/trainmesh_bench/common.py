"""What every benchmark shares: a trainmesh model built from a :class:`Setup` through the public API, its
training step, and timed pairs of steps of two implementations.

Each timed pair is one step of each on the same batch, back to back, so drift hits both alike; the figure
is the median of per-pair ratios with min and max. Benchmarks print, tests check (docs/performance.md)."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainmesh as tm
from trainmesh import api
from trainmesh.distributed.comm import log_all_gather
from trainmesh.data import TokenData, get_batch
from trainmesh.distributed.mesh import Mesh
from trainmesh.layout import Layout
from trainmesh.tracking.metrics import SavedActivations
from trainmesh.models import preset, spec_of
from trainmesh.plan import Workload
from trainmesh.training.precision import dtype_of

StepFn = Callable[[int], None]
Rates = dict[str, list[float]]  # tokens/s of each timed pair's step, per implementation
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
RSS_STEPS = 3


@dataclass
class Result:
    """One row of a benchmark: a trainmesh form beside its torch peer (``peer_tokens_per_s`` empty and
    ``note`` saying why when the peer cannot run here)."""

    form: str
    ours: str
    peer: str
    tokens_per_s: list[float]
    peer_tokens_per_s: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    peer_peak_rss: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def ratios(self) -> list[float]:
        """trainmesh / peer tokens/s of each timed pair (its two steps share a moment)."""
        return [a / b for a, b in zip(self.tokens_per_s, self.peer_tokens_per_s)]

    def summary(self) -> dict:
        ratios = self.ratios
        stats = ({"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
                 if ratios else {})
        return {**asdict(self), **stats, "tokens_per_s_median": statistics.median(self.tokens_per_s)}

    def line(self) -> str:
        ratios = self.ratios
        ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "n/a")
        rss = (f"  peak RSS {max(self.peak_rss) / 2**20:.0f} vs {max(self.peer_peak_rss) / 2**20:.0f} MiB"
               if self.peak_rss and self.peer_peak_rss else "")
        note = f"  ({self.note})" if self.note else ""
        return (f"  {self.ours} / {self.peer}: ratio {ratio}, {statistics.median(self.tokens_per_s):,.0f} tokens/s"
                f"{rss}{note}")


def write_results(results: Sequence[Result], path: str) -> None:
    """Rank 0 writes the rows as JSON, for ``trainmesh bench all`` to assemble."""
    if path and dist.get_rank() == 0:
        Path(path).write_text(json.dumps([r.summary() for r in results], indent=1))


def peak_rss(step: StepFn, first: int, count: int = RSS_STEPS) -> int:
    """Peak resident bytes over ``count`` steps. Before each step the heap's free memory is handed back
    to the OS (glibc ``malloc_trim``) and the kernel's high-water mark is reset (Linux ``clear_refs``), so
    the figure is what is resident during this implementation's steps, not what earlier work left behind."""
    libc = ctypes.CDLL(None)
    peak = 0
    for i in range(first, first + count):
        gc.collect()
        libc.malloc_trim(0)
        CLEAR_REFS.write_text("5")
        step(i)
        line = next(x for x in STATUS.read_text().splitlines() if x.startswith("VmHWM:"))
        peak = max(peak, int(line.split()[1]) * 1024)
    return peak


@dataclass(frozen=True)
class Setup:
    """What a benchmark trains: the preset ``model`` (its family) with ``model_config`` (the preset's unless
    given: ``trainmesh bench`` hands the one its flags make), the ``layout``, ``steps`` of AdamW as ``trainmesh
    train`` runs them (warm-up, then cosine decay), the data, and where the mesh runs. The layout's settings
    read through (``setup.dp``, ``setup.world``)."""

    model: str
    layout: Layout = Layout()
    global_batch: int = 16
    model_config: Any = None
    seed: int = 0
    data: str = ""
    tokenizer: str = ""
    steps: int = 50
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "auto"
    backend: str = "auto"
    collective_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.model_config is None:
            object.__setattr__(self, "model_config", preset(self.model))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "layout":
            raise AttributeError(name)
        return getattr(self.layout, name)

    def with_layout(self, **changes: Any) -> Setup:
        """The same setup in a layout with ``changes``."""
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, **changes))

    @property
    def micro_batch(self) -> int:
        """Sequences in one micro-batch on one data-parallel rank."""
        return self.global_batch // (self.layout.dp * self.layout.microbatches)

    @property
    def workload(self) -> Workload:
        """What the planner prices of this setup: the model's shape, the global batch and the dtypes."""
        shape = spec_of(self.model).shape(self.model_config)
        return Workload(shape, self.global_batch, self.model_config.seq_len, self.layout.precision,
                        self.layout.reduce_dtype)



@dataclass
class Bench:
    """One trainmesh training setup a benchmark measures: the settings it was built from, the public API's
    parallel model and optimizer (what a script holds), and the data its batches are drawn from."""

    cfg: Setup
    model: tm.ParallelModel
    opt: tm.Optimizer
    data: TokenData

    @property
    def mesh(self) -> Mesh:
        return self.model.mesh

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's share of the global batch of ``step``, as ``trainmesh train`` draws it (only its
        sequences are read), so that every implementation trains on the same tokens."""
        cfg, mesh = self.cfg, self.mesh
        return get_batch(self.data.train, cfg.model_config.seq_len, cfg.global_batch, cfg.seed, step,
                         mesh.rank("dp"), mesh.size("dp"))

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of ``step`` on its device: what a torch peer feeds its model."""
        return api.rank_slice(self.mesh, self.batch(step), self.cfg.microbatches, dp_sliced=True)


def init_mesh(cfg: Setup) -> Mesh:
    """Join the job and build the mesh of ``cfg``'s layout (:func:`trainmesh.init_mesh`)."""
    return tm.init_mesh(cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.device, cfg.backend, cfg.collective_timeout, cfg.ep,
                        sequence_parallel=cfg.sequence_parallel)


def model_of(cfg: Setup, device: torch.device) -> torch.nn.Module:
    """``cfg.model`` as its family builds it from ``cfg.seed``, on ``device`` in ``cfg.precision``."""
    return spec_of(cfg.model).builder(cfg.model_config, cfg.seed).to(device, dtype_of(cfg.precision))


def build(cfg: Setup, mesh: Mesh) -> Bench:
    """``cfg``'s model with its parallel forms applied through the public API (:func:`trainmesh.parallelize`,
    :func:`trainmesh.optimizer`), as ``trainmesh train`` builds it, and its data."""
    model = tm.parallelize(model_of(cfg, mesh.device), mesh, tp_plan=dict(spec_of(cfg.model).tp_plan),
                           **cfg.layout.forms())
    opt = tm.optimizer(model, cfg.lr, cfg.betas, cfg.weight_decay)
    return Bench(cfg, model, opt, TokenData.load(cfg.data, cfg.model_config.seq_len, cfg.tokenizer))


def fresh_model(bench: Bench) -> torch.nn.Module:
    """``bench``'s model as built from its seed, for a torch peer (or a bound) to train beside it."""
    return model_of(bench.cfg, bench.mesh.device)


def trainmesh_step(bench: Bench, saved: SavedActivations | None = None) -> StepFn:
    """Step ``i`` of ``bench`` as ``trainmesh train`` takes it (:func:`trainmesh.train_step` on this rank's share
    of batch ``i``, clipped to ``--grad-clip``); ``saved`` records the first micro-batch's activations."""
    def step(i: int) -> None:
        tm.train_step(bench.model, bench.opt, bench.batch(i), max_norm=bench.cfg.grad_clip, dp_sliced=True, saved=saved)

    return step


def timed(step: StepFn, first: int, count: int, device: torch.device) -> float:
    """Seconds for steps ``first`` .. ``first + count - 1`` on every rank, from a barrier to a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(first, first + count):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - t0


def alternating_times(steps: Sequence[StepFn], first_step: int, rounds: int, per_visit: int,
                      device: torch.device) -> list[list[float]]:
    """Seconds of each timed step of each of ``steps`` (barrier to barrier), in ``rounds`` rounds that visit
    every one for ``per_visit`` steps, the order reversed each round, so that none always runs first and the
    machine's drift falls on all alike. Round r runs steps ``first_step + r * per_visit`` onwards of each."""
    times: list[list[float]] = [[] for _ in steps]
    for r in range(rounds):
        for k in range(len(steps))[::1 if r % 2 == 0 else -1]:
            for i in range(per_visit):
                times[k].append(timed(steps[k], first_step + r * per_visit + i, 1, device))
    return times


def compare(steps: dict[str, StepFn], tokens_per_step: int, pairs: int, device: torch.device, warmup: int = 2) -> Rates:
    """Tokens/s of each step function in each of ``pairs`` timed pairs, after ``warmup`` untimed steps each
    (0 where the caller has run some already). Pair k runs step ``2 + k`` of every implementation, the order
    reversed from one pair to the next (:func:`alternating_times`)."""
    for step in steps.values():
        timed(step, 0, warmup, device)
    times = alternating_times(list(steps.values()), 2, pairs, 1, device)
    return {name: [tokens_per_step / t for t in ts] for name, ts in zip(steps, times)}


def rss_after(steps: dict[str, StepFn], pairs: int) -> dict[str, list[int]]:
    """Peak RSS of every rank during a few untimed steps of each implementation, after the timed pairs."""
    first = 2 + pairs
    return {name: all_ranks(peak_rss(step, first)) for name, step in steps.items()}


def all_ranks(value: int) -> list[int]:
    """``value`` of every rank, in rank order."""
    return log_all_gather(torch.tensor([value], dtype=torch.int64)).reshape(-1).tolist()
