"""The host transport proven against torch.distributed: the suite's equivalence tests run with
``TRAINMESH_HOST_TRANSPORT=off`` (``conftest.py``), the path NCCL runs on GPUs, so these show that one host's
shared memory (``auto``) trains the very same bits, layout by layout, and that the switch and each run's
summary say which path was taken."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainmesh.app import cli
from trainmesh.app.config import Config
from trainmesh.distributed.shm import TRANSPORT_ENV
from trainmesh.distributed.testing import run_ranks

from helpers import Training, differences, in_fp64, train_rank

LAYOUTS = {  # on 2 ranks, every collective the host transport carries: sums, all-gathers, reduce-scatters, messages
    "dp2": dict(dp=2),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "pp2 1f1b mb2": dict(pp=2, microbatches=2),
    "dp2 zero3": dict(dp=2, zero=3),
}


def _trainings(setting: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Training], list[str]]:
    """Every layout trained for 3 float64 steps on 2 ranks under ``TRAINMESH_HOST_TRANSPORT=setting``, with the
    transport each run's ``summary.json`` records."""
    monkeypatch.setenv(TRANSPORT_ENV, setting)
    base = Config.from_settings(nproc=2, steps=3, global_batch=8, warmup_steps=1, progress=False, tensorboard=False)
    cfgs = [in_fp64(base.replace(out=str(out / setting / name.replace(" ", "-")), **layout))
            for name, layout in LAYOUTS.items()]
    trainings = run_ranks(train_rank, 2, cfgs, timeout=240)[0]
    return trainings, [json.loads(Path(cfg.logging.out, "summary.json").read_text())["transport"] for cfg in cfgs]


def test_the_host_transport_trains_the_same_bits_as_torch_distributed(tmp_path, monkeypatch):
    """Bitwise, not within the equivalence bound: over 2 ranks every sum has two terms, and a + b is b + a
    exactly, whichever rank adds (the segment sums in rank order, Gloo's ring as it goes), and each path
    divides by 2 before or after summing, which gives the same bits. So a wrong element, a sum over the wrong
    slice, a message into the wrong buffer on either path shows here, however small."""
    shared, shared_transports = _trainings("auto", tmp_path, monkeypatch)
    plain, plain_transports = _trainings("off", tmp_path, monkeypatch)
    assert shared_transports == ["shm+torch.distributed"] * len(LAYOUTS)
    assert plain_transports == ["torch.distributed"] * len(LAYOUTS)
    for layout, through_torch, through_shm in zip(LAYOUTS, plain, shared):
        loss_diff, param_diff = differences(through_torch, through_shm)
        assert (loss_diff, param_diff) == (0.0, 0.0), f"{layout}: |dloss| {loss_diff:.2e}, |dparam| {param_diff:.2e}"


def test_the_flag_sets_the_variable_and_a_bad_value_is_refused_in_one_line(monkeypatch, capsys):
    """``--host-transport off`` reaches the ranks through the environment the launcher hands them; a value of
    the variable that is neither auto nor off stops the command before any rank starts."""
    monkeypatch.setenv(TRANSPORT_ENV, "auto")
    cli.checked_config(cli._parser().parse_args(["train", "--host-transport", "off"]))
    assert os.environ[TRANSPORT_ENV] == "off"
    monkeypatch.setenv(TRANSPORT_ENV, "shm")
    assert cli.main(["train", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (f"trainmesh: error: {TRANSPORT_ENV}='shm' is not one of auto, off; set it "
                                       f"to auto (shared memory between one host's ranks) or off (everything "
                                       f"through torch.distributed)\n")
