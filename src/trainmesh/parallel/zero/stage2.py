"""ZeRO stage 2, P_os+g (§5.2): gradients, too, are kept as a 1/N shard per rank, reduce-scattered during
every micro-batch's backward (``no_sync`` does not defer, as in DeepSpeed): Ψ(N-1)/N per extra
micro-batch for 1/N of the gradient memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from trainmesh.distributed.comm import Comm
from trainmesh.training.optim import OptimizerFactory
from trainmesh.parallel.data_parallel import axis_buckets
from trainmesh.parallel.zero.base import DEFAULT_BUCKET_BYTES, ZeroEngine, trainable
from trainmesh.parallel.zero.flat import Group, sharded_group
from trainmesh.training.precision import LossScaler


def stage2_bucket_bytes(params: Sequence[nn.Parameter], bucket_bytes: int, world: int, grad_dtype: torch.dtype) -> int:
    """Stage 2's bucket: ``bucket_bytes``, but at most 1/(2N) of the full gradient's bytes, so its transient
    full buckets add at most one gradient shard and the peak stays below stage 1's."""
    itemsize = torch.empty((), dtype=grad_dtype).element_size()
    grad_bytes = sum(p.numel() for p in params) * itemsize
    return max(1, min(bucket_bytes, grad_bytes // (2 * world)))


class ZeroStage2(ZeroEngine):
    """P_os+g (§5.2): full parameters; each complete bucket's gradients are staged in a transient flat buffer and
    reduce-scattered into the persistent 1/N shard during backward, landing by the end of the backward pass (or of
    :meth:`backward_pass`, for the zero-bubble split, Qi et al. 2023, §2)."""

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp", groups: list[Group] | None = None) -> None:
        if groups is None:
            params = list(reversed(trainable(module)))
            bucket_bytes = stage2_bucket_bytes(params, bucket_bytes, comm.mesh.size(axis), reduce_dtype)
            buckets = axis_buckets(params, bucket_bytes, axis)
            groups = [sharded_group(f"bucket{i}", b, comm, a, reduce_dtype) for i, (a, b) in enumerate(buckets)]
        super().__init__(module, comm, make_optimizer, groups, scaler, axis)
        self._callback_queued = False
        self._in_pass = self._input_only = False
        for group in self.groups:
            for p in group.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextlib.contextmanager
    def backward_pass(self, input_only: bool = False) -> Iterator[None]:
        """Treat the autograd calls inside as one backward pass, ended once on exit (not on an error, after which the
        ranks' collectives no longer match anyway); ``input_only``: they compute no parameter gradient."""
        self._in_pass, self._input_only = True, input_only
        try:
            yield
            self._end_of_backward()
        finally:
            self._in_pass = self._input_only = False

    def _queue_end_of_backward(self) -> None:
        if not (self._callback_queued or self._in_pass):
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        if not self._input_only:
            self._land_all()
        self._callback_queued = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Count ``p``'s gradient in; once its group has them all, stage them and launch the reduce-scatters in order,
        so a group's full buffer lives only from its last gradient to its landing, as FSDP2's unsharded gradients."""
        self._queue_end_of_backward()
        group, _ = self._slot[p]
        self._note_peak()
        group.pending -= 1
        self.events.append(("ready", group.name))
        if group.pending == 0:
            self._on_group_ready(group)
            self._stage_grads(group)
        self._launch_ready()

    def _reduce_target(self, group: Group) -> torch.Tensor:
        """The gradient shard itself while it is still empty (the first pass of a step): the sum lands
        where it is kept, with no buffer and no addition (adding to zero would give the same values)."""
        return group.grad_shard if group.shard_empty else super()._reduce_target(group)

    def _on_group_ready(self, group: Group) -> None:
        """Hook for stage 3, which frees the unit's parameters once its gradients are all in."""

    def _launch(self, group: Group) -> None:
        super()._launch(group)
        for earlier in self._in_flight[:-1]:
            self._land(earlier)

