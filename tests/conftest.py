"""Shared fixtures: every test runs with one CPU thread per process so ranks don't fight over cores; the
float64 equivalence margins measured in this session are printed as a table at the end.

Ranks exchange through torch.distributed, not one host's shared memory (``TRAINMESH_HOST_TRANSPORT=off``,
inherited by every rank the tests start), so that the equivalence tests prove the calls NCCL runs on GPUs;
the tests of the shared-memory path set ``auto`` themselves (``test_shm.py``, ``test_host_transport.py``).
Set the variable to ``auto`` before pytest to run the whole suite through shared memory instead."""

import os

import pytest
import torch

from helpers import EQUIVALENCE_TABLE, FP64_ATOL
from trainmesh.distributed.shm import TRANSPORT_ENV

os.environ.setdefault(TRANSPORT_ENV, "off")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter) -> None:
    if not EQUIVALENCE_TABLE:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"float64 equivalence vs one process (bound {FP64_ATOL:g})")
    write(f"{'layout':<40} {'max |dloss|':>12} {'max |dparam|':>13}")
    for layout, loss_diff, param_diff in sorted(EQUIVALENCE_TABLE):
        write(f"{layout:<40} {loss_diff:>12.2e} {param_diff:>13.2e}")
