"""ZeRO stage 1, P_os (§5.1): each rank keeps AdamW state for its 1/N of the elements only, the largest part
of the model state, for DP's communication: reduce-scatter, local update, all-gather (2Ψ(N-1)/N)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from trainmesh.distributed.comm import Comm
from trainmesh.training.optim import OptimizerFactory
from trainmesh.parallel.data_parallel import BucketFold, accumulating_locally, axis_buckets, fold_grad_into
from trainmesh.parallel.zero.base import DEFAULT_BUCKET_BYTES, ZeroEngine, trainable
from trainmesh.parallel.zero.flat import Group, flatten_params
from trainmesh.training.precision import LossScaler


class ZeroStage1(ZeroEngine):
    """P_os (§5.1): full parameters and gradients (accumulated as in DP, ``BucketFold`` across dtypes), AdamW
    state for this rank's shard; buckets are reduce-scattered as the last micro-batch's backward completes them."""

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp") -> None:
        buckets = axis_buckets(list(reversed(trainable(module))), bucket_bytes, axis)
        groups = [self._group(i, b, comm, a, reduce_dtype) for i, (a, b) in enumerate(buckets)]
        super().__init__(module, comm, make_optimizer, groups, scaler, axis)
        self.sync = True
        self._fold = BucketFold({g.name: len(g.params) for g in self.groups})
        for group in self.groups:
            for p in group.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    @staticmethod
    def _group(index: int, params: list[nn.Parameter], comm: Comm, axis: str, grad_dtype: torch.dtype) -> Group:
        layout, flat = flatten_params(params, comm, axis)
        grad_flat = torch.zeros_like(flat, dtype=grad_dtype)
        return Group(f"bucket{index}", params, layout, flat, layout.shard_of(flat), layout.shard_of(grad_flat),
                     grad_flat=grad_flat, axis=axis)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return accumulating_locally(self)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        group, i = self._slot[p]
        view = group.layout.view(group.grad_flat, i)
        if view.dtype != p.dtype:
            self._fold.add(group.name, p, view)
        else:
            fold_grad_into(view, p)
        if not self.sync:
            return
        self.events.append(("ready", group.name))
        group.pending -= 1
        self._launch_ready()

    def _store(self, group: Group, reduced: torch.Tensor) -> None:
        group.grad_shard.copy_(reduced)

    def finish_gradient_sync(self) -> None:
        self._land_all()

    def zero_grad(self) -> None:
        for group in self.groups:
            group.grad_flat.zero_()
            for p, view in zip(group.params, group.layout.views(group.grad_flat)):
                p.grad = view if view.dtype == p.dtype else None
        self._release_optimizer_grads()
        self.events.clear()

