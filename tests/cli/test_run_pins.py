"""Runs and checkpoints that cannot be swapped or overwritten underneath (issue 33): step numbers of any
width, checkpoints that lack a tensor of their model, retention (``--keep-last``), a finished run's folder,
TensorBoard on a full disk, symbolic links planted in a run folder, and the tokenizer pinned by content."""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import trainmesh as tm
from trainmesh import checkpoint
from trainmesh.mesh import Mesh


def _mesh() -> Mesh:
    return Mesh.build(1, 1, 1, torch.device("cpu"))


def _tiny() -> tuple[tm.ParallelModel, tm.Optimizer]:
    torch.manual_seed(0)
    model = tm.parallelize(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)).double(), _mesh(), precision="fp64")
    return model, tm.optimizer(model, lr=1e-2)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def test_a_step_past_99999999_is_found_as_the_newest(tmp_path):
    """Step directories sort by number: ``step-100000000`` (nine digits) is newer than ``step-00000005``,
    also with no ``latest`` pointer to say so."""
    model, opt = _tiny()
    tm.save(model, opt, tmp_path, step=5)
    tm.train_step(model, opt, _batch())
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert tm.save(model, opt, tmp_path, step=100_000_000).name == "step-100000000"
    (tmp_path / checkpoint.LATEST).unlink()
    fresh, fresh_opt = _tiny()
    assert tm.load(fresh, fresh_opt, tmp_path) == 100_000_000
    assert all(torch.equal(v, trained[k]) for k, v in fresh.state_dict().items())
