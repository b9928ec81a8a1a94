"""What the ZeRO stages share (:class:`ZeroEngine`): the sharded optimizer, ordered gradient reduce-scatters, the step.

Mixed precision (Micikevicius et al., 2018; ZeRO §3.1, K = 12) keeps an fp32 master of this rank's shard only;
gradients are reduced in ``reduce_dtype``, clipped in fp32, and a non-finite global norm skips the step on every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.mesh import REPLICA_AXIS, SHARD_AXIS
from trainmesh.tracking.metrics import optimizer_tensors, storage_bytes
from trainmesh.training.engine import ReplicaSync
from trainmesh.training.optim import OptimizerFactory, ParamPiece, clipped_update, norm_contributions
from trainmesh.parallel.data_parallel import sum_over_tp, sum_tied
from trainmesh.parallel.tensor_parallel import defer_tp_sums
from trainmesh.parallel.zero import flat
from trainmesh.parallel.zero.flat import Group, make_pieces, master_shard
from trainmesh.training.precision import LossScaler

DEFAULT_BUCKET_BYTES = 25 * 2**20

NORM_AXES = ("tp", "pp")  # with the sharding axis: shards are disjoint there, so the squares are summed too


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The parameters the engines shard and the optimizer updates: frozen ones stay whole and unsynced."""
    return [p for p in module.parameters() if p.requires_grad]


class ZeroEngine:
    """What the stages share: the sharded AdamW, gradient reduce-scatter in index order on every rank (so
    collectives match, as in DataParallel), the step, accounting. Backward on the loss times :attr:`loss_scale`."""

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory, groups: list[Group],
                 scaler: LossScaler | None, axis: str) -> None:
        self.module, self.comm, self.axis, self.groups = module, comm, axis, groups
        self.scaler = scaler or LossScaler(enabled=False)
        for group in groups:
            group.master = master_shard(group.shard)
        self.pieces, self._piece_slots = make_pieces(groups)
        self.optimizer = make_optimizer([(f"piece{i}", p) for i, p in enumerate(self.pieces)])
        self._slot = {p: (g, i) for g in groups for i, p in enumerate(g.params)}
        self._tp_summed = [g for g in groups if defer_tp_sums(g.params)]  # their shards summed over tp at the step
        self._next_launch = 0
        self._in_flight: list[Group] = []
        self._reset_pending()
        self.events: list[tuple[str, ...]] = []
        self.peak_state_bytes: int | None = None
        self.replica_sync: ReplicaSync | None = None  # set by trainmesh.replicas: the replica groups are torchft's

    @property
    def replicas(self) -> int:
        """Replica groups of hybrid sharding (1 without): each holds every shard of the sharding axis."""
        return self.comm.mesh.size(REPLICA_AXIS) if self.axis == SHARD_AXIS else 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks a gradient is averaged over: the sharding axis times its replicas."""
        return self.comm.mesh.size(self.axis) * self.replicas

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def _reset_pending(self) -> None:
        for group in self.groups:
            group.pending = len(group.params)
        self._next_launch = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 2 and 3 reduce-scatter every micro-batch (:mod:`~trainmesh.parallel.zero.stage2`): nothing
        to defer."""
        yield

    @contextlib.contextmanager
    def backward_pass(self, input_only: bool = False) -> Iterator[None]:
        """Mark the autograd calls inside as one micro-batch's backward (see :class:`~.stage2.ZeroStage2`); stage 1
        reduces once per step, so it needs nothing here."""
        yield

    def unshard_for_backward(self, params: Sequence[nn.Parameter]) -> None:
        """Stages 1 and 2 hold the full parameters: nothing to gather (see
        :class:`~trainmesh.parallel.zero.stage3.ZeroStage3`)."""

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.groups) and self.groups[self._next_launch].pending == 0:
            self._launch(self.groups[self._next_launch])

    def _launch(self, group: Group) -> None:
        """Start the reduce-scatter of ``group``'s full gradient, averaged, into a fresh shard."""
        group.reduce_out = self._reduce_target(group)
        group.reduce_work = flat.reduce_scatter_shards(self.comm, group.reduce_out, group.grad_flat, group.axis,
                                                       "grad_reduce_scatter", divisor=self.dp)
        self.events.append(("reduce_scatter", group.name))
        self._in_flight.append(group)
        self._next_launch += 1
        self._note_peak()

    def _reduce_target(self, group: Group) -> torch.Tensor:
        """Where ``group``'s reduce-scatter writes: a fresh buffer that :meth:`_store` folds in."""
        return torch.empty_like(group.grad_shard)

    def _land(self, group: Group) -> None:
        """Wait for ``group``'s reduce-scatter and fold the result into its gradient shard."""
        group.reduce_work.wait()
        self._store(group, group.reduce_out)
        group.reduce_out = group.reduce_work = None
        self._in_flight.remove(group)

    def _store(self, group: Group, reduced: torch.Tensor) -> None:
        if reduced is not group.grad_shard:
            group.grad_shard.add_(reduced)
        group.shard_empty = False
        group.grad_flat = None

    def _land_all(self) -> None:
        """Launch the groups that got no gradient (zeros, so every rank issues the same collectives), land all."""
        while self._next_launch < len(self.groups):
            group = self.groups[self._next_launch]
            if group.grad_flat is None:
                self._stage_grads(group)
            self._launch(group)
        self._land_in_flight()
        self._reset_pending()

    def _stage_grads(self, group: Group) -> None:
        """Copy ``group``'s gradients into a fresh zero-filled flat buffer and drop them, after the reduce-scatters in
        flight land, so one group's full gradient is staged at a time."""
        self._land_in_flight()
        full = group.grad_shard.new_empty(group.layout.padded)
        full[group.layout.numel:].zero_()
        held = [(view, p.grad) for view, p in zip(group.layout.views(full), group.params) if p.grad is not None]
        if len(held) < len(group.params):
            full.zero_()
        if held:
            torch._foreach_copy_([view for view, _ in held], [grad for _, grad in held])
        group.grad_flat = full
        self._note_peak()
        for p in group.params:
            p.grad = None

    def _land_in_flight(self) -> None:
        """Wait for every reduce-scatter in flight and fold each into its gradient shard."""
        for group in list(self._in_flight):
            self._land(group)

    def finish_gradient_sync(self) -> None:
        """Stages 2 and 3 land every reduce-scatter at the end of each backward; nothing is left here."""

    def step(self, lr: float, max_norm: float) -> float:
        """Finish gradient sync, unscale and clip the shards by the whole model's norm, update and re-gather; returns
        the unscaled pre-clip norm, a non-finite one skipping the step on every rank."""
        self.finish_gradient_sync()
        if not self._sum_over_replicas():
            self.zero_grad()
            return math.nan
        sum_over_tp([g.grad_shard for g in self._tp_summed], self.comm)
        sum_tied([(g.params, g.grad_shard) for g in self.groups], self.comm)
        grads = self._optimizer_grads()
        norm = clipped_update(self.optimizer, grads, norm_contributions(self.pieces, self.comm.mesh.rank("tp")),
                              self.comm, (self.axis, *NORM_AXES), self.scaler, lr, max_norm)
        if math.isfinite(norm):
            self._copy_masters_to_shards()
            self.after_update()
        self.zero_grad()
        return norm

    def _sum_over_replicas(self) -> bool:
        """Hybrid sharding (as FSDP2's 2-D mesh and DeepSpeed's MiCS): all-reduce each gradient shard over the replica
        groups once per step, so only Ψ/S bytes per rank cross between groups. Returns whether to update: replica
        groups under :mod:`trainmesh.replicas` average over the groups alive and may give the step up."""
        if self.replica_sync is not None:
            return self.replica_sync([g.grad_shard for g in self.groups])
        if self.replicas == 1:
            return True
        works = [self.comm.all_reduce(g.grad_shard, REPLICA_AXIS, op="grad_replica_all_reduce", async_op=True)
                 for g in self.groups]
        for work in works:
            work.wait()
        return True

    def _optimizer_grads(self) -> list[torch.Tensor]:
        """Point each piece's gradient at its slice of the reduced shard in the masters' dtype (a view, or a per-step
        copy freed by :meth:`zero_grad`); returns the gradient shards the optimizer reads."""
        grads = {g.name: g.grad_shard.to(g.master.dtype) for g in self.groups}
        for piece, slot in zip(self.pieces, self._piece_slots):
            piece.grad = grads[slot.group.name][slot.start:slot.end].view(piece.shape)
        self._note_peak()
        return list(grads.values())

    @torch.no_grad()
    def _copy_masters_to_shards(self) -> None:
        """Round the updated fp32 masters into the low-precision parameter shards (nothing to do in fp32)."""
        for group in self.groups:
            if group.master is not group.shard:
                group.shard.copy_(group.master)

    def after_update(self) -> None:
        """All-gather the updated shards into the full parameters (stages 1 and 2, §5.1)."""
        gathers = []
        for group in self.groups:
            source = group.shard.clone()
            work = flat.gather_shards(self.comm, group.flat, source, group.axis, "param_all_gather")
            gathers.append((source, work))
        for _, work in gathers:
            work.wait()

    def gathered(self) -> contextlib.AbstractContextManager:
        """Stages 1 and 2 hold the full parameters."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for group in self.groups:
            group.grad_shard.zero_()
            group.shard_empty = True
        self._release_optimizer_grads()
        self.events.clear()

    def _release_optimizer_grads(self) -> None:
        for piece in self.pieces:
            piece.grad = None

    def param_pieces(self) -> list[ParamPiece]:
        """This rank's shard of each parameter for checkpoints: elements ``[start, end)`` of it flattened, as the
        optimizer's fp32 piece and the parameter shard's slice. Call :meth:`after_update` after writing them."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        pieces = iter(self.pieces)
        out = []
        for group in self.groups:
            lo = group.layout.rank * group.layout.shard_numel
            for i, start, end in group.layout.pieces():
                base = lo - group.layout.offsets[i]
                piece = next(pieces)
                out.append(ParamPiece(names[id(group.params[i])], start + base, end + base, piece.detach().view(-1),
                                      group.shard[start:end], piece))
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of model state this rank holds now: a freed buffer has an empty storage."""
        params = list(self.module.parameters())
        held = [t for g in self.groups for t in (g.flat, g.shard, g.master, g.grad_shard, g.grad_flat, g.reduce_out)]
        return (params + [p.grad for p in params] + [q.grad for q in self.pieces] + held
                + optimizer_tensors(self.optimizer))

    def _note_peak(self) -> None:
        """Track the most model state held during a step while :attr:`peak_state_bytes` is a number (set it to start);
        off (``None``) by default, since each sample walks every state tensor."""
        if self.peak_state_bytes is not None:
            self.peak_state_bytes = max(self.peak_state_bytes, storage_bytes(self.state_tensors()))

