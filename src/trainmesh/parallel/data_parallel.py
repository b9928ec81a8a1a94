"""Data parallelism: every rank holds the whole model; gradients are averaged by bucketed AllReduce, as PyTorch DDP
(Li et al., VLDB 2020, §3.2): gradients are views into reverse-order buckets, each launched asynchronously once
complete, in index order so collectives match across ranks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.parallel.expert_parallel import EXPERT_AXIS, experts_on_any_stage, is_expert, reduction_axis
from trainmesh.tracking.metrics import model_state_tensors
from trainmesh.training.engine import ReplicaSync
from trainmesh.training.optim import (TIED_PEER, OptimizerFactory, ParamPiece, clipped_update, keep_tp_marks,
                                      norm_contributions)
from trainmesh.parallel.tensor_parallel import defer_tp_sums, is_tp_partial
from trainmesh.training.precision import LossScaler, copy_masters_to_model, master_dtype, masters


@dataclass
class Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor
    axis: str = "dp"
    pending: int = 0
    work: object | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    tp_sum: bool = False  # its gradients are partial over tp: summed there once per step (defer_tp_sums)


def split_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of about ``bucket_bytes`` each, one dtype per run."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if groups[-1] and (size + nbytes > bucket_bytes or p.dtype != groups[-1][0].dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def axis_buckets(params: list[nn.Parameter], bucket_bytes: int, axis: str) -> list[tuple[str, list[nn.Parameter]]]:
    """:func:`split_buckets` of ``params`` with each bucket's reduction axis: dense over ``axis`` first, then
    routed experts over the edp axis, so no bucket mixes groups; tp-partial parameters
    (:func:`~trainmesh.parallel.tensor_parallel.defer_tp_sums`) and a tied weight (:func:`sum_tied`) get buckets
    of their own."""
    out = []
    for reduced_over in (axis, EXPERT_AXIS):
        kinds: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for p in params:
            if (reduction_axis(p, axis) == axis) == (reduced_over == axis):
                kinds.setdefault((is_tp_partial(p), getattr(p, TIED_PEER, None) is not None), []).append(p)
        out += [(reduced_over, b) for kind in sorted(kinds) for b in split_buckets(kinds[kind], bucket_bytes)]
    return out


def sum_over_tp(grads: Sequence[torch.Tensor], comm: Comm) -> None:
    """Sum each of ``grads`` (buckets of gradients partial over tp, :func:`~trainmesh.parallel.tensor_parallel.
    defer_tp_sums`) over tp in place, the all-reduces in flight together."""
    for work in [comm.all_reduce(g, "tp", op="sequence_grads", async_op=True) for g in grads]:
        if work is not None:
            work.wait()


def sum_tied(groups: Sequence[tuple[Sequence[nn.Parameter], torch.Tensor]], comm: Comm) -> None:
    """Add the other pipeline end's gradient to each of ``groups``' (params, gradient) that holds a tied weight
    (:data:`~trainmesh.training.optim.TIED_PEER`), so embedding and head step as one weight (Megatron-LM's
    embedding group). A weight alone in its group is laid out alike on both ends, so each exchanges its shard."""
    for params, grad in groups:
        peers = {getattr(p, TIED_PEER, None) for p in params} - {None}
        if not peers:
            continue
        if len(params) > 1:
            raise ValueError("a tied embedding shares its ZeRO-3 unit with other parameters; give the embedding "
                             "and the head units of their own")
        theirs = torch.empty_like(grad)
        peer = comm.mesh.global_rank(pp=peers.pop())
        for work in comm.send_recv([(grad, peer)], [(theirs, peer)], op="tied_grads"):
            work.wait()
        grad.add_(theirs)


def fold_grad_into(view: torch.Tensor, p: nn.Parameter) -> None:
    """Make ``view`` (a bucket slice) hold ``p``'s accumulated gradient: ``p.grad`` is the view where dtypes
    agree (copied back if reset to None), else each micro-batch's gradient is added in and dropped."""
    if view.dtype != p.dtype:
        view.add_(p.grad)
        p.grad = None
    elif p.grad is not view:
        view.copy_(p.grad)
        p.grad = view


class BucketFold:
    """Adds low-precision gradients into their wider bucket views a bucket at a time, with one
    ``torch._foreach_add_`` instead of one kernel per parameter and micro-batch. Buckets left incomplete
    are folded at the end of backward (autograd's queued callback, as DDP's reducer)."""

    def __init__(self, sizes: Mapping[Hashable, int]) -> None:
        self.sizes = dict(sizes)
        self.held: dict[Hashable, dict[nn.Parameter, torch.Tensor]] = {key: {} for key in self.sizes}
        self.queued = False

    def add(self, bucket: Hashable, p: nn.Parameter, view: torch.Tensor) -> None:
        """Hold ``p``'s fresh gradient for ``bucket`` (``view``: its slice); fold the bucket once complete. A
        parameter held twice (its gradient accumulated by autograd in between) is added once."""
        self.held[bucket][p] = view
        if len(self.held[bucket]) == self.sizes[bucket]:
            self.fold(bucket)
        elif not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.fold_all)

    def fold(self, bucket: Hashable) -> None:
        held = self.held[bucket]
        if held:
            torch._foreach_add_(list(held.values()), [p.grad for p in held])
            for p in held:
                p.grad = None
            held.clear()

    def fold_all(self) -> None:
        self.queued = False
        for bucket in self.held:
            self.fold(bucket)


def make_buckets(params: list[nn.Parameter], bucket_bytes: int, dtype: torch.dtype | None = None,
                 axis: str = "dp") -> list[Bucket]:
    """Group ``params`` (in reverse order of use) into buckets of about ``bucket_bytes`` of ``dtype`` gradients
    (default: the parameter's), reduced over ``axis`` or, for routed experts, the edp axis (:func:`axis_buckets`)."""
    buckets = []
    for bucket_axis, group in axis_buckets(params, bucket_bytes, axis):
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype or group[0].dtype, device=group[0].device)
        buckets.append(Bucket(group, flat, bucket_axis, views=flat_views(flat, group), tp_sum=defer_tp_sums(group)))
    return buckets


def flat_views(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Consecutive slices of ``flat``, one per parameter in order, each shaped like its parameter."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


class Syncing(Protocol):
    sync: bool
    """False while gradients only accumulate locally: the post-accumulate hooks then launch nothing."""


@contextlib.contextmanager
def accumulating_locally(engine: Syncing) -> Iterator[None]:
    """An engine's ``no_sync``: gradients accumulate locally inside (for all but the last micro-batch of a
    step), and the reduction is launched once, by the backward that follows with ``sync`` set again."""
    engine.sync = False
    try:
        yield
    finally:
        engine.sync = True


class DataParallel:
    """Gradient synchronisation for a replicated, unwrapped ``module`` over ``comm``'s ``dp`` axis: backward on the
    loss times :attr:`loss_scale` (in :meth:`no_sync` but for the last micro-batch), then :meth:`step`; low-precision
    parameters get fp32 masters and ``reduce_dtype`` gradients (Megatron's ``main_grad``)."""

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = 25 * 2**20, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp") -> None:
        self.module = module
        self.comm = comm
        self.axis = axis
        self.sync = True
        self.replica_sync: ReplicaSync | None = None  # set by trainmesh.replicas: this dp world is one replica group
        self.scaler = scaler or LossScaler(enabled=False)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = params = [p for _, p in named]
        self.routed_norm = experts_on_any_stage(params, comm)
        # routed experts' squares: summed over ep and etp, whose ranks hold different experts or slices, and over tp
        # unless the expert groups fold over tp (then they hold every tp rank's already: :attr:`Mesh.experts_over_tp`)
        self._routed_axes = ("ep", "etp", "pp") if comm.mesh.experts_over_tp else ("ep", "etp", "tp", "pp")
        self._broadcast_parameters(params)
        self.masters = self._make_masters(params)
        opt_params = self.masters if self.masters else params
        self.optimizer = make_optimizer([(n, q) for (n, _), q in zip(named, opt_params)])
        self.buckets = make_buckets(list(reversed(params)), bucket_bytes, reduce_dtype, axis)
        self._slot: dict[nn.Parameter, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._slot[p] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._point_grads_at_buckets()
        self._fold = BucketFold({i: len(b.params) for i, b in enumerate(self.buckets)})
        self._next_launch = 0
        self._reset_pending()
        self.events: list[tuple[str, int]] = []

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @staticmethod
    def _make_masters(params: list[nn.Parameter]) -> list[nn.Parameter]:
        if all(p.dtype == master_dtype(p.dtype) for p in params):
            return []
        copies = masters(params)
        for m, p in zip(copies, params):
            keep_tp_marks(m, p)
        return copies

    def _point_grads_at_buckets(self) -> None:
        """Gradients are views into the buckets wherever the dtypes agree."""
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view if view.dtype == p.dtype else None

    def _view(self, p: nn.Parameter) -> torch.Tensor:
        b, i = self._slot[p]
        return self.buckets[b].views[i]

    def _broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Start every rank from dp-rank 0's weights, whatever each rank initialised (a routed expert from
        the first rank holding the same experts)."""
        with torch.no_grad():
            for p in params:
                self.comm.broadcast(p.data, reduction_axis(p, self.axis), op="init_broadcast")

    def _reset_pending(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None
        self._next_launch = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, _ = self._slot[p]
        view = self._view(p)
        if view.dtype != p.dtype:
            self._fold.add(b, p, view)
        else:
            fold_grad_into(view, p)
        if not self.sync:
            return
        self.events.append(("ready", b))
        self.buckets[b].pending -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self._next_launch)

    def _launch(self, index: int) -> None:
        """Average over every data-parallel rank's tokens: a routed expert's gradient already sums its
        ep group's tokens, so its bucket too is divided by the ``dp x cp`` size, summed over ``edp``."""
        bucket = self.buckets[index]
        bucket.work = self.comm.all_reduce(bucket.flat, bucket.axis, async_op=True,
                                           divisor=self.comm.mesh.size(self.axis))
        self.events.append(("launch", index))
        self._next_launch = index + 1

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return accumulating_locally(self)

    @contextlib.contextmanager
    def backward_pass(self, input_only: bool = False) -> Iterator[None]:
        """Buckets are all-reduced once per step, whatever the number of autograd calls: nothing to do."""
        yield

    def unshard_for_backward(self, params: Sequence[nn.Parameter]) -> None:
        """Every rank holds the full parameters: nothing to gather."""

    def finish_gradient_sync(self) -> None:
        """Launch buckets of parameters that got no gradient, then wait for every AllReduce."""
        while self._next_launch < len(self.buckets):
            self._launch(self._next_launch)
        for bucket in self.buckets:
            bucket.work.wait()
        self._reset_pending()

    def step(self, lr: float, max_norm: float) -> float:
        """Finish the AllReduce, unscale, clip by the global norm and update; returns the pre-clip norm. The norm
        is reduced over ``tp`` and ``pp`` (and experts over ``ep``, on every stage: :func:`experts_on_any_stage`);
        a non-finite norm skips the update on every rank."""
        self.finish_gradient_sync()
        if self.replica_sync is not None and not self.replica_sync([b.flat for b in self.buckets]):
            self.zero_grad()
            return math.nan
        sum_over_tp([b.flat for b in self.buckets if b.tp_sum], self.comm)
        sum_tied([(b.params, b.flat) for b in self.buckets], self.comm)
        opt_params = self.masters or self.params
        grads = self._optimizer_grads(opt_params)
        tp_rank = self.comm.mesh.rank("tp")
        experts = [is_expert(p) for p in self.params]
        dense = norm_contributions([q for q, e in zip(opt_params, experts) if not e], tp_rank)
        routed = norm_contributions([q for q, e in zip(opt_params, experts) if e], tp_rank)
        norm = clipped_update(self.optimizer, grads, dense, self.comm, ("tp", "pp"), self.scaler, lr, max_norm,
                              extra=(routed, self._routed_axes) if self.routed_norm else None)
        if math.isfinite(norm) and self.masters:
            copy_masters_to_model(self.masters, self.params)
        for m in self.masters:
            m.grad = None
        self.zero_grad()
        return norm

    def _optimizer_grads(self, opt_params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Point the optimizer's parameters at the reduced gradients: bucket views where dtypes agree, else views of
        each bucket converted whole, one copy per bucket rather than one kernel per parameter."""
        owner = dict(zip(self.params, opt_params))
        for bucket in self.buckets:
            flat = bucket.flat.to(owner[bucket.params[0]].dtype)
            for p, view in zip(bucket.params, flat_views(flat, bucket.params)):
                owner[p].grad = view
        return [q.grad for q in opt_params]

    def param_pieces(self) -> list[ParamPiece]:
        """Every trainable parameter whole (each rank holds all of it), for checkpoints: its fp32 master
        (the parameter itself in fp32 training), the parameter, and the optimizer's key to its state."""
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        return [ParamPiece(n, 0, p.numel(), q.detach().view(-1), p.detach().view(-1), q)
                for n, p, q in zip(names, self.params, self.masters or self.params)]

    def state_tensors(self) -> list[torch.Tensor]:
        """What :func:`trainmesh.tracking.metrics.storage_bytes` counts as this rank's model state."""
        return model_state_tensors(self.module, self.optimizer) + self.masters + [b.flat for b in self.buckets]

    def after_update(self) -> None:
        """Nothing to do: every rank holds its parameters whole and checkpoints write them directly."""

    def gathered(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()
        self._point_grads_at_buckets()
        self.events.clear()
