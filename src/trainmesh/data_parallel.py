"""Data parallelism: every rank holds the whole model; gradients are averaged by bucketed AllReduce.

The design follows PyTorch DDP (Li et al., VLDB 2020, §3.2): parameters are grouped into buckets in
*reverse* order of registration (roughly the order backward produces their gradients); each gradient is
a view into its bucket's flat buffer, so autograd accumulates straight into the buffer; a
post-accumulate-grad hook counts ready gradients and launches the bucket's asynchronous AllReduce the
moment the bucket is complete, so communication overlaps the rest of backward. Buckets are launched in
index order on every rank (a later bucket waits for earlier ones) so the collectives match across ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.metrics import model_state_tensors
from trainmesh.optim import clip_, global_norm, norm_contributions


@dataclass
class Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor
    pending: int = 0
    work: object | None = None
    views: list[torch.Tensor] = field(default_factory=list)


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group ``params`` (already in reverse order of use) into buckets of about ``bucket_bytes``."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if groups[-1] and (size + nbytes > bucket_bytes or p.dtype != groups[-1][0].dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = []
    for group in groups:
        flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
        bucket = Bucket(group, flat)
        offset = 0
        for p in group:
            bucket.views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        buckets.append(bucket)
    return buckets


class DataParallel:
    """Gradient synchronisation for a replicated ``module`` over the ``dp`` axis of ``comm``'s mesh.

    Use: run forward and backward as usual (inside :meth:`no_sync` for all but the last micro-batch of a
    step), then :meth:`step`. The module itself is not wrapped, so its parameter names and
    ``state_dict`` are unchanged. ``optimizer`` is built over ``module``'s parameters.
    """

    def __init__(self, module: nn.Module, comm: Comm, optimizer: torch.optim.Optimizer,
                 bucket_bytes: int = 25 * 2**20, axis: str = "dp") -> None:
        self.module = module
        self.comm = comm
        self.optimizer = optimizer
        self.axis = axis
        self.sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        self._broadcast_parameters(params)
        self.buckets = make_buckets(list(reversed(params)), bucket_bytes)
        self._slot: dict[nn.Parameter, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._slot[p] = (b, i)
                p.grad = bucket.views[i]
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._next_launch = 0
        self._reset_pending()
        self.events: list[tuple[str, int]] = []

    def _broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Start every rank from dp-rank 0's weights, whatever each rank initialised."""
        with torch.no_grad():
            for p in params:
                self.comm.broadcast(p.data, self.axis, op="init_broadcast")

    def _reset_pending(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None
        self._next_launch = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, i = self._slot[p]
        bucket = self.buckets[b]
        if p.grad is not bucket.views[i]:
            # The optimizer or user set grads to None; fold the fresh gradient back into the bucket.
            bucket.views[i].copy_(p.grad)
            p.grad = bucket.views[i]
        if not self.sync:
            return
        self.events.append(("ready", b))
        bucket.pending -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self._next_launch)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.flat.div_(self.comm.mesh.size(self.axis))
        bucket.work = self.comm.all_reduce(bucket.flat, self.axis, async_op=True)
        self.events.append(("launch", index))
        self._next_launch = index + 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (for all but the last micro-batch of a step)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish_gradient_sync(self) -> None:
        """Launch buckets of parameters that got no gradient, then wait for every AllReduce."""
        while self._next_launch < len(self.buckets):
            self._launch(self._next_launch)
        for bucket in self.buckets:
            bucket.work.wait()
        self._reset_pending()

    def step(self, lr: float, max_norm: float) -> float:
        """Finish the gradient AllReduce, clip by the global norm, update; returns the norm before clipping.

        The norm is reduced over ``tp`` and ``pp`` (the axes that split a replicated model) but not over
        ``dp``, whose ranks all hold the same averaged gradient.
        """
        self.finish_gradient_sync()
        params = [p for b in self.buckets for p in b.params]
        norm = global_norm(norm_contributions(params, self.comm.mesh.rank("tp")), self.comm, ("tp", "pp"))
        clip_([p.grad for p in params], norm, max_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.zero_grad()
        return norm.item()

    def state_tensors(self) -> list[torch.Tensor]:
        """What :func:`trainmesh.metrics.storage_bytes` counts as this rank's model state."""
        return model_state_tensors(self.module, self.optimizer)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
        self.events.clear()
