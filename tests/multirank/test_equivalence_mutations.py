"""The equivalence check can fail: each case plants one real bug in a parallel run (inside the ranks only)
and asserts that the float64 comparison with one process rejects it. A check whose bound hid these would
prove nothing about the layouts it passes."""

from __future__ import annotations

import pytest
import torch

import trainmesh.api
import trainmesh.parallel.zero.flat
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.testing import run_ranks

from helpers import FP64_ATOL, Case, check_equivalent, config, differences, in_fp64, train_rank, train_single


def _perturb_contribution(scale: float) -> None:
    """Make rank 0's input to every dp-axis gradient all-reduce wrong: scaled by ``scale``."""
    original = Comm.all_reduce

    def wrong(self, tensor, axis, *args, **kwargs):
        if axis == "dp" and self.rank == 0 and kwargs.get("op", "all_reduce") == "all_reduce":
            with torch.no_grad():
                tensor.mul_(scale)
        return original(self, tensor, axis, *args, **kwargs)

    Comm.all_reduce = wrong


def _shift_zero_gradients(shift: int) -> None:
    """Make rank 0's gradients entering every ZeRO reduce-scatter over dp rolled by ``shift`` elements (a shard
    boundary off by that much), whichever way the shards are exchanged
    (:func:`trainmesh.parallel.zero.flat.reduce_scatter_shards`: patched on its module, where every stage looks
    it up when it calls it)."""
    original = trainmesh.parallel.zero.flat.reduce_scatter_shards

    def wrong(comm, out, full, axis, op, **kwargs):
        if axis == "dp" and comm.rank == 0:
            with torch.no_grad():
                full.copy_(torch.roll(full, shift))
        return original(comm, out, full, axis, op, **kwargs)

    trainmesh.parallel.zero.flat.reduce_scatter_shards = wrong


def _drop_last_microbatch() -> None:
    """Every rank trains its first micro-batch twice and never sees its last one (in the one batch slicer that
    the command line's loop and a script's ``train_step`` share)."""
    original = trainmesh.api.rank_slice

    def dropped(*args, **kwargs):
        micro = original(*args, **kwargs)
        return [*micro[:-1], micro[0]]

    trainmesh.api.rank_slice = dropped


MUTATIONS = {
    "a dp gradient contribution off by 1e-6 relative": lambda: _perturb_contribution(scale=1 + 1e-6),
    "a ZeRO gradient shard off by one element": lambda: _shift_zero_gradients(shift=1),
    "a dropped micro-batch": _drop_last_microbatch,
}


def mutated_rank(cases: list[Case], mutation: str) -> list:
    MUTATIONS[mutation]()
    return train_rank(cases)


CASES = {
    "a dp gradient contribution off by 1e-6 relative": config(dp=2, steps=3, warmup_steps=1),
    "a ZeRO gradient shard off by one element": config(dp=2, zero=2, steps=3, warmup_steps=1),
    "a dropped micro-batch": config(dp=2, microbatches=2, steps=3, warmup_steps=1),
}


@pytest.mark.parametrize("mutation", list(CASES))
def test_the_equivalence_check_rejects_a_planted_bug(mutation):
    case = in_fp64(CASES[mutation])
    parallel = run_ranks(mutated_rank, 2, [case], mutation, timeout=240)[0][0]
    loss_diff, param_diff = differences(train_single(case), parallel)
    assert max(loss_diff, param_diff) > 100 * FP64_ATOL, (
        f"{mutation}: |dloss| {loss_diff:.2e}, |dparam| {param_diff:.2e} would pass the equivalence check")


def test_the_same_layouts_unmutated_pass():
    """The control: without the planted bugs the same three layouts are equivalent."""
    check_equivalent(list(CASES.values()), world_size=2)
