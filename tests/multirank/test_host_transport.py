"""The host transport proven against torch.distributed: the suite's equivalence tests run with
``TRAINMESH_HOST_TRANSPORT=off`` (``conftest.py``), the path NCCL runs on GPUs, so these show that one host's
shared memory (``auto``) trains the very same bits, layout by layout, and that the switch and each run's
communicator says which path was taken."""

from __future__ import annotations

import pytest
import torch

from trainmesh.distributed.shm import TRANSPORT_ENV
from trainmesh.distributed.testing import run_ranks

from helpers import Case, Training, config, differences, in_fp64, train

LAYOUTS = {  # on 2 ranks, every collective the host transport carries: sums, all-gathers, reduce-scatters, messages
    "dp2": dict(dp=2),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "pp2 1f1b mb2": dict(pp=2, microbatches=2),
    "dp2 zero3": dict(dp=2, zero=3),
}


def _train_with_transport(cases: list[Case]) -> list[tuple[Training, str]]:
    """Runs on every rank: each case's training and the transport its communicator took (what a run's
    ``summary.json`` records)."""
    torch.set_num_threads(1)
    runs = [train(case) for case in cases]
    return [((run.losses, run.parallel.state_dict()), run.comm.transport) for run in runs]


def _trainings(setting: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Training], list[str]]:
    """Every layout trained for 3 float64 steps on 2 ranks under ``TRAINMESH_HOST_TRANSPORT=setting``, with the
    transport each took."""
    monkeypatch.setenv(TRANSPORT_ENV, setting)
    cases = [in_fp64(config(steps=3, warmup_steps=1, **layout)) for layout in LAYOUTS.values()]
    trainings, transports = zip(*run_ranks(_train_with_transport, 2, cases, timeout=240)[0])
    return list(trainings), list(transports)


def test_the_host_transport_trains_the_same_bits_as_torch_distributed(monkeypatch):
    """Bitwise, not within the equivalence bound: over 2 ranks every sum has two terms, and a + b is b + a
    exactly, whichever rank adds (the segment sums in rank order, Gloo's ring as it goes), and each path
    divides by 2 before or after summing, which gives the same bits. So a wrong element, a sum over the wrong
    slice, a message into the wrong buffer on either path shows here, however small."""
    shared, shared_transports = _trainings("auto", monkeypatch)
    plain, plain_transports = _trainings("off", monkeypatch)
    assert shared_transports == ["shm+torch.distributed"] * len(LAYOUTS)
    assert plain_transports == ["torch.distributed"] * len(LAYOUTS)
    for layout, through_torch, through_shm in zip(LAYOUTS, plain, shared):
        loss_diff, param_diff = differences(through_torch, through_shm)
        assert (loss_diff, param_diff) == (0.0, 0.0), f"{layout}: |dloss| {loss_diff:.2e}, |dparam| {param_diff:.2e}"
