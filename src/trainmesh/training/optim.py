"""AdamW, the learning-rate schedule and gradient clipping by the norm of the whole model's gradient,
assembled from per-rank sums of squares with each element counted once (a tp-replicated parameter only
on tp-rank 0, a tied embedding only on the first pipeline stage, an expert's down-projection bias only on the first
etp rank, as Megatron-LM's ``clip_grad_norm``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.training.precision import LossScaler, master_dtype

TP_SHARDED = "_trainmesh_tp_sharded"
SPLIT_OVER_TP = "_trainmesh_split_over_tp"
"""On a parameter each tp rank holds a different one of, though no tensor-parallel layer split it: a routed
expert of an ep group that folds over tp. The global norm counts it on every tp rank, as a tp shard."""
COUNTED_ELSEWHERE = "_trainmesh_counted_elsewhere"
"""On a copy of a parameter that a rank of an axis the global norm sums over also holds and counts: a routed expert's
down-projection bias on every etp rank but the first (the etp ranks split the rest of the expert)."""
TIED_PEER = "_trainmesh_tied_peer"
"""On a weight the first and the last pipeline stage both hold (an output head tied to the embedding): the other
end's ``pp`` coordinate. Engines add the other end's gradient at the step; the norm counts the first stage's."""


@dataclass(frozen=True)
class ParamPiece:
    """Elements ``[start, end)`` of parameter ``name`` flattened (of its tp shard) as a rank's optimizer holds
    them, so a checkpoint restores them in any layout: ``master`` the fp32 copy, ``param`` the model's,
    ``optim_param`` the key to their AdamW state."""

    name: str
    start: int
    end: int
    master: torch.Tensor
    param: torch.Tensor
    optim_param: nn.Parameter


def param_groups(params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only; biases and norm gains are not decayed (GPT-2/Megatron convention)."""
    decay, no_decay = [], []
    for _, p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


OptimizerFactory = Callable[[Iterable[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
"""Builds a form's optimizer over the (named) tensors it updates: whole parameters, or ZeRO's shards."""


def build_adamw(named_params: Iterable[tuple[str, nn.Parameter]], device: torch.device, lr: float,
                betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW with the fused kernel on CUDA and CPU, the multi-tensor (foreach) one elsewhere. On CPU too the fused
    kernel makes one pass over each tensor instead of foreach's dozen, several times faster (docs/performance.md)."""
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(named_params, weight_decay), lr=lr, betas=betas, eps=1e-8,
                             fused=fused, foreach=not fused)


def adamw_factory(device: torch.device, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                  weight_decay: float = 0.1) -> OptimizerFactory:
    """:func:`build_adamw` with its settings bound, for a form to call on the tensors it shards."""
    return lambda named: build_adamw(named, device, lr, betas, weight_decay)


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at step ``steps``."""

    lr: float
    min_lr: float
    warmup_steps: int
    steps: int

    def at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


def is_tp_sharded(p: torch.Tensor) -> bool:
    return getattr(p, TP_SHARDED, False)


def norm_contributions(params: Iterable[nn.Parameter], tp_rank: int) -> list[torch.Tensor]:
    """The gradients this rank adds to the global norm: each element of the model counted once."""
    return [p.grad for p in params if p.grad is not None and (tp_rank == 0 or differs_over_tp(p))
            and getattr(p, TIED_PEER, None) != 0 and not getattr(p, COUNTED_ELSEWHERE, False)]


def keep_tp_marks(copy: torch.Tensor, p: torch.Tensor) -> None:
    """Give ``copy`` (an optimizer's master or shard piece of ``p``) ``p``'s marks of how tp holds it, so that
    the global norm counts each element once (:func:`norm_contributions`)."""
    setattr(copy, TP_SHARDED, is_tp_sharded(p))
    setattr(copy, SPLIT_OVER_TP, getattr(p, SPLIT_OVER_TP, False))
    setattr(copy, TIED_PEER, getattr(p, TIED_PEER, None))
    setattr(copy, COUNTED_ELSEWHERE, getattr(p, COUNTED_ELSEWHERE, False))


def differs_over_tp(p: torch.Tensor) -> bool:
    """Whether tp ranks hold different values of ``p``: a tp shard, or an expert split over tp ranks."""
    return is_tp_sharded(p) or getattr(p, SPLIT_OVER_TP, False)


def global_norm(grads: Sequence[torch.Tensor], comm: Comm, axes: Sequence[str]) -> torch.Tensor:
    """L2 norm over all ranks of ``grads``, summing squares over ``axes`` (those that split the model)."""
    return squared_norm(grads, comm, axes).sqrt()[0]


def squared_norm(grads: Sequence[torch.Tensor], comm: Comm, axes: Sequence[str]) -> torch.Tensor:
    """Sum of squares over all ranks of ``grads`` (shape ``[1]``), summed over ``axes``."""
    device = comm.mesh.device
    if grads:
        norms = torch._foreach_norm([g.to(master_dtype(g.dtype)) for g in grads])
        sq = (torch.stack(norms).double() ** 2).sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    sq = sq.reshape(1).to(device)
    for axis in axes:
        comm.all_reduce(sq, axis, op="grad_norm")
    return sq


def unscale_and_clip_(grads: Sequence[torch.Tensor], total_norm: float, max_norm: float,
                      loss_scale: float = 1.0) -> None:
    """Divide ``grads`` by the loss scale and clip to global norm ``max_norm`` (0: none) in one pass, by a Python
    number so CUDA runs one multi-tensor kernel; ``total_norm`` is the unscaled norm."""
    coef = 1.0 / loss_scale
    if max_norm > 0:
        coef *= min(max_norm / (total_norm + 1e-6), 1.0)
    if coef != 1.0:
        torch._foreach_mul_(list(grads), coef)


def clipped_update(optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor],
                   contributions: Sequence[torch.Tensor], comm: Comm, axes: Sequence[str], scaler: LossScaler,
                   lr: float, max_norm: float,
                   extra: tuple[Sequence[torch.Tensor], Sequence[str]] | None = None) -> float:
    """One guarded optimizer step shared by every engine; returns the unscaled pre-clip norm. The norm is
    reduced over ``axes`` (``extra`` adds contributions with their own axes), so a non-finite one skips the
    step and backs the loss scale off on every rank together. The caller copies masters back."""
    sq = squared_norm(contributions, comm, axes)
    if extra is not None:
        sq = sq + squared_norm(extra[0], comm, extra[1])
    norm = (sq.sqrt()[0] / scaler.scale).item()
    if not math.isfinite(norm):
        scaler.update(found_inf=True)
        return norm
    unscale_and_clip_(grads, norm, max_norm, scaler.scale)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    scaler.update(found_inf=False)
    return norm
