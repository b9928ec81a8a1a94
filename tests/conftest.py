"""Shared fixtures: every test runs with one CPU thread per process so ranks don't fight over cores."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
