"""Low-precision gradients fold into the fp32 buckets one multi-tensor add per bucket, to exactly the
per-parameter sum in the same order, including buckets some of whose parameters got no gradient."""

import contextlib

import pytest
import torch
from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.distributed.mesh import Mesh
from trainmesh.training.optim import adamw_factory
from trainmesh.parallel.data_parallel import DataParallel


class TwoLayers(nn.Module):
    """Two linears and one parameter the forward never uses, so the bucket holding it is never complete."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)
        self.unused = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 600])  # one bucket for all; several, each of few tensors
def test_bf16_gradients_of_each_micro_batch_fold_into_fp32_buckets_as_their_exact_sum(monkeypatch, bucket_bytes):
    torch.manual_seed(0)
    model = TwoLayers().to(torch.bfloat16)
    reference = TwoLayers().to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    dp = DataParallel(model, Comm(Mesh.build(1, 1, 1, torch.device("cpu"))),
                      adamw_factory(torch.device("cpu"), 1e-3), bucket_bytes=bucket_bytes)
    adds = []
    foreach_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda views, grads: adds.append(len(views)) or foreach_add(views, grads))
    batches = [torch.randn(5, 16, dtype=torch.bfloat16) for _ in range(3)]
    expected = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in reference.named_parameters()}
    for i, x in enumerate(batches):
        with dp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            model(x).float().square().mean().backward()
        reference.zero_grad(set_to_none=True)
        reference(x).float().square().mean().backward()
        for name, p in reference.named_parameters():
            if p.grad is not None:
                expected[name] += p.grad.float()
    dp.finish_gradient_sync()
    for name, p in model.named_parameters():
        assert p.grad is None, name
        assert torch.equal(dp._view(p), expected[name]), name
    trained = len(list(model.parameters())) - 1
    reached = sum(any(p is not model.unused for p in b.params) for b in dp.buckets)  # buckets getting gradients
    assert sum(adds) == len(batches) * trained and len(adds) == len(batches) * reached
