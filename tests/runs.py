"""What the command-line tests share: a ``trainmesh train`` run's :class:`Config` as they write it, and its
one-process reference. The parallel-form proofs train through the public API instead (:mod:`helpers`)."""

from __future__ import annotations

import torch

from trainmesh.app.config import Config
from trainmesh.app.train import train
from trainmesh.distributed.mesh import Mesh

from helpers import Training

DEFAULTS = {"steps": 10, "global_batch": 8, "warmup_steps": 2, "progress": False}
_REFERENCES: dict[str, Training] = {}  # one-process runs already trained in this pytest process


def config(**settings) -> Config:
    """:data:`DEFAULTS` (ten steps of eight sequences, two warm-up steps, no progress line) under ``settings``,
    started on as many processes as the layout has ranks unless ``nproc`` is given."""
    cfg = Config.from_settings(**{**DEFAULTS, **settings})
    return cfg if "nproc" in settings else cfg.replace(nproc=cfg.layout.world)


def in_fp64(cfg: Config) -> Config:
    """The same run in float64, gradients reduced in float64."""
    return cfg.replace(precision="fp64", reduce_dtype="auto")


def train_single(cfg: Config) -> Training:
    """The same run as one process (same global batch and micro-batches), trained once per thread count
    unless it reads or writes checkpoints."""
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
