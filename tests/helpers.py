"""What the equivalence tests share: train in this process as the single-process reference, train on N
ranks, and compare per-step losses and final parameters."""

from __future__ import annotations

import dataclasses

import torch

from trainmesh.config import Config
from trainmesh.mesh import Mesh
from trainmesh.testing import run_ranks
from trainmesh.train import full_state_dict, train

LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5


def train_single(cfg: Config) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same config as one process (dp=tp=pp=1, same global batch and micro-batches)."""
    single = dataclasses.replace(cfg, nproc=1, dp=1, tp=1, pp=1, zero=0)
    result = train(single, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    return result.losses, full_state_dict(result.run)


def train_rank(cfgs: list[Config]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """Runs on every rank: train each config in turn; returns losses and full parameters per config."""
    torch.set_num_threads(1)
    out = []
    for cfg in cfgs:
        result = train(cfg)
        out.append((result.losses, full_state_dict(result.run)))
    return out


def assert_same_training(reference, parallel, param_atol: float = PARAM_ATOL) -> None:
    ref_losses, ref_params = reference
    losses, params = parallel
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= LOSS_ATOL, f"step {step}: loss {a} vs single-process {b}"
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        diff = (params[name] - ref_params[name]).abs().max().item()
        assert diff <= param_atol, f"{name}: max |diff| {diff} vs single process"


def check_equivalent(cfgs: list[Config], world_size: int, timeout: float = 240.0,
                     param_atol: float = PARAM_ATOL) -> None:
    """Every config trained on ``world_size`` ranks matches its single-process run (rank 0's view)."""
    results = run_ranks(train_rank, world_size, cfgs, timeout=timeout)
    for cfg, parallel in zip(cfgs, results[0]):
        assert_same_training(train_single(cfg), parallel, param_atol)
