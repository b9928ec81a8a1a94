"""Staging for async checkpoints (checkpoint.store.HostBuffers): a copy training cannot change, in pinned
host memory reused save after save on a GPU (the GPU case runs in scripts/gpu_check.sh)."""

import pytest
import torch

from trainmesh.checkpoint.store import HostBuffers


def test_cpu_state_is_copied_so_training_can_overwrite_it():
    src = torch.arange(6.0).view(2, 3)
    staged = HostBuffers().copy("w@0,0", src)
    src.add_(1)
    assert torch.equal(staged, torch.arange(6.0).view(2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
def test_gpu_state_is_staged_into_pinned_buffers_reused_by_the_next_save():
    host = HostBuffers()
    src = torch.randn(1024, 1024, device="cuda")
    first = host.copy("w@0,0", src)
    host.settle()
    assert first.is_pinned() and torch.equal(first, src.cpu())
    src.mul_(2)
    again = host.copy("w@0,0", src)
    host.settle()
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, src.cpu())
    other = host.copy("w@0,0", src.to(torch.bfloat16))
    host.settle()
    assert other.dtype == torch.bfloat16 and other.is_pinned()
