"""Shared fixtures: every test runs with one CPU thread per process so ranks don't fight over cores; the
float64 equivalence margins measured in this session are printed as a table at the end."""

import pytest
import torch

from helpers import EQUIVALENCE_TABLE, FP64_ATOL


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
