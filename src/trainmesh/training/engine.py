"""The one contract every training engine (DataParallel or ZeRO) fulfils: the loop, the pipeline runtime
and checkpoints talk to it only through :class:`Engine`, so a new form is one class."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from trainmesh.training.optim import ParamPiece
from trainmesh.training.precision import LossScaler

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ReplicaSync = Callable[[list[torch.Tensor]], bool]
"""Averages a step's reduced gradients over the replica groups alive (in place) and says whether to update:
the hook :mod:`trainmesh.replicas` sets on an engine whose world is one replica group of a torchft job."""
MicroBatches = Sequence[tuple]
"""Each micro-batch ``(inputs, targets)``, or ``(inputs, targets, packing)`` with a
:class:`~trainmesh.models.documents.Packing` of its documents."""


class Engine(Protocol):
    """Gradient synchronisation, the optimizer step, and the state a checkpoint saves. Backward runs on the loss times
    :attr:`loss_scale` (1 except under fp16 loss scaling)."""

    scaler: LossScaler
    optimizer: torch.optim.Optimizer

    @property
    def loss_scale(self) -> float: ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients without synchronising them (every micro-batch but the last)."""

    def backward_pass(self, input_only: bool = False) -> contextlib.AbstractContextManager:
        """Several autograd calls that form one backward pass (the zero-bubble split)."""

    def unshard_for_backward(self, params: Sequence[nn.Parameter]) -> None:
        """Make ``params`` whole before an autograd call that starts inside their module."""

    def finish_gradient_sync(self) -> None:
        """Wait for every gradient reduction launched during backward."""

    def step(self, lr: float, max_norm: float) -> float:
        """Clip by the global gradient norm, update, zero the gradients; returns the norm (inf: skipped)."""

    def zero_grad(self) -> None: ...

    def param_pieces(self) -> list[ParamPiece]:
        """The parameter elements this rank's optimizer updates, for checkpoints."""

    def after_update(self) -> None:
        """Bring the model's parameters in line with the optimizer's copies after they were written
        (a checkpoint load)."""

    def gathered(self) -> contextlib.AbstractContextManager:
        """Parameters whole for the duration (ZeRO-3 gathers them; the other forms hold them whole)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of model state this rank holds, for memory accounting."""
