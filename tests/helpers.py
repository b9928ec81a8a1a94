"""What the equivalence tests share: train in this process as the single-process reference, train on N
ranks, and compare per-step losses and final parameters.

Equivalence is proven in float64. A layout changes only the order in which sums are taken (a gradient
reduced over ranks, a loss split over micro-batches or vocabulary shards); in float64 each such sum is
off by at most about n·u·Σ|x| with u = 1.1e-16, and ten steps of AdamW can amplify a gradient difference δ
into at most lr·δ/eps = 3e-3·δ/1e-8 per parameter. With δ ~ 1e-13 that is 3e-8 in the worst case and
~1e-14 in practice (measured: |Δloss| 9e-16, |Δparam| 5e-15 at DP=2), so :data:`FP64_ATOL` = 1e-9 leaves
five orders of magnitude for a machine's summation order and none for a real bug: the mutation tests
(``test_equivalence_mutations.py``) perturb one reduction by 1e-6 and see this check fail. fp32 would hide
such a bug under its own noise (its AdamW-amplified parameter differences reach 1e-5 on some CPUs).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainmesh.app.config import Config
from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.testing import run_ranks
from trainmesh.app.train import train

FP64_ATOL = 1e-9

EQUIVALENCE_TABLE: list[tuple[str, float, float]] = []  # (layout, |Δloss|, |Δparam|), printed by conftest

Training = tuple[list[float], dict[str, torch.Tensor]]


DEFAULTS = {"steps": 10, "global_batch": 8, "warmup_steps": 2, "progress": False}


def config(**settings) -> Config:
    """The one way the tests build a run's settings: :data:`DEFAULTS` (ten steps of eight sequences, two
    warm-up steps, no progress line) under ``settings``, started on as many processes as the layout has
    ranks unless ``nproc`` is given."""
    cfg = Config.from_settings(**{**DEFAULTS, **settings})
    return cfg if "nproc" in settings else cfg.replace(nproc=cfg.layout.world)


def in_fp64(cfg: Config) -> Config:
    """The config an equivalence test runs: the same layout in float64 (gradients reduced in float64)."""
    return cfg.replace(precision="fp64", reduce_dtype="auto")


_REFERENCES: dict[str, Training] = {}  # single-process runs already trained in this pytest process


def train_single(cfg: Config) -> Training:
    """The reference: the same config as one process (dp=cp=tp=pp=1, same global batch and micro-batches).

    Many layouts share one reference, and training is deterministic for a given thread count, so a run
    that writes nothing besides its metrics is trained once per test session and thread count, and reused."""
    single = cfg.replace(nproc=1, dp=1, cp=1, tp=1, pp=1, ep=1, zero=0, sequence_parallel=False,
                         schedule="1f1b", virtual_stages=1, stage_layers=())
    reusable = not (single.checkpoint.checkpoint_dir or single.checkpoint.init_from)
    key = f"{torch.get_num_threads()} threads: {single.replace(out='')!r}"
    if reusable and key in _REFERENCES:
        return _REFERENCES[key]
    result = train(single, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    training = result.losses, result.run.parallel.state_dict()
    if reusable:
        _REFERENCES[key] = training
    return training


def train_rank(cfgs: list[Config]) -> list[Training]:
    """Runs on every rank: train each config in turn; returns losses and full parameters per config."""
    torch.set_num_threads(1)
    out = []
    for cfg in cfgs:
        result = train(cfg)
        out.append((result.losses, result.run.parallel.state_dict()))
    return out


def _per_item(reference: Training, parallel: Training) -> tuple[list[float], dict[str, float]]:
    """|Δloss| of every step and max |Δ| of every parameter."""
    (ref_losses, ref_params), (losses, params) = reference, parallel
    assert len(losses) == len(ref_losses), f"{len(losses)} steps vs the single process's {len(ref_losses)}"
    assert params.keys() == ref_params.keys(), f"parameter names differ: {params.keys() ^ ref_params.keys()}"
    return ([abs(a - b) for a, b in zip(losses, ref_losses)],
            {n: (params[n].double() - ref_params[n].double()).abs().max().item() for n in ref_params})


def differences(reference: Training, parallel: Training) -> tuple[float, float]:
    """Largest per-step |Δloss| and largest |Δparam| over every parameter."""
    loss_diffs, param_diffs = _per_item(reference, parallel)
    return max(loss_diffs), max(param_diffs.values())


def assert_same_training(reference: Training, parallel: Training) -> tuple[float, float]:
    """Per-step losses and final parameters within :data:`FP64_ATOL`; returns the two largest differences."""
    loss_diffs, param_diffs = _per_item(reference, parallel)
    for step, diff in enumerate(loss_diffs):
        assert diff <= FP64_ATOL, f"step {step}: loss {parallel[0][step]!r} vs single-process {reference[0][step]!r}"
    for name, diff in param_diffs.items():
        assert diff <= FP64_ATOL, f"{name}: max |diff| {diff} vs single process"
    return max(loss_diffs), max(param_diffs.values())


def check_equivalent(cfgs: list[Config], world_size: int, timeout: float = 240.0) -> list[tuple[float, float]]:
    """Every config, run in float64 on ``world_size`` ranks, matches its single-process run within
    :data:`FP64_ATOL` (rank 0's view); returns (|Δloss|, |Δparam|) per config."""
    cfgs = [in_fp64(cfg) for cfg in cfgs]
    results = run_ranks(train_rank, world_size, cfgs, timeout=timeout)
    diffs = []
    for cfg, parallel in zip(cfgs, results[0]):
        diffs.append(assert_same_training(train_single(cfg), parallel))
        EQUIVALENCE_TABLE.append((describe_layout(cfg), *diffs[-1]))
    return diffs


def describe_layout(cfg: Config) -> str:
    """A short name for a layout, e.g. ``dp2 tp2 sp pp2 1f1b zero1 mb2``."""
    parts = [f"{axis}{getattr(cfg.layout, axis)}" for axis in ("dp", "cp", "ep", "tp") if getattr(cfg.layout, axis) > 1]
    parts += [f"hsdp{cfg.layout.dp_replicate}x{cfg.layout.dp // cfg.layout.dp_replicate}"] if cfg.layout.dp_replicate > 1 else []
    parts += [cfg.layout.cp_impl] if cfg.layout.cp > 1 else []
    parts += ["sp"] if cfg.layout.sequence_parallel else []
    if cfg.layout.pp > 1:
        parts += [f"pp{cfg.layout.pp}", cfg.layout.schedule + (f" v{cfg.layout.virtual_stages}" if cfg.layout.virtual_stages > 1 else "")]
    parts += [f"zero{cfg.layout.zero}"] if cfg.layout.zero else []
    parts += [f"mb{cfg.layout.microbatches}"] if cfg.layout.microbatches > 1 else []
    return " ".join(parts + ([cfg.model.model] if cfg.model.model != "tiny" else [])) or "single"


PAGE = 4096  # what a tmpfs allocates at a time


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``where``, a file system that really fills (as root; the test is
    skipped where mounting is not allowed)."""
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill_disk(disk: Path, leave_pages: int) -> None:
    """Fill ``disk`` until it is full, then give back ``leave_pages`` pages."""
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x" * PAGE)
        f.truncate(max(0, f.tell() - leave_pages * PAGE))


def word_tokenizer(path: Path, words: list[str]) -> Path:
    """A word-level ``tokenizer.json`` of ``words`` (and ``[UNK]``) at ``path``: two of them of the same size
    differ by content only."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def child_pids(pid: int | str = "self") -> set[int]:
    """The processes whose parent is ``pid`` (this process by default), from each of its threads'
    ``/proc/PID/task/TID/children`` (Linux)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids
