"""The loss of a step as the mean over the trained tokens of its global batch, whatever the layout.

A target of :data:`IGNORE_INDEX` is not trained (a prompt token of chat data, a window's padding). Each
micro-batch's mean over its trained tokens is divided by :func:`divisors`' share, so that the ranks' gradients,
averaged over dp x cp by the engine, are those of one mean over every trained token of the global batch: a mean
of per-micro-batch means would weigh a micro-batch with few trained tokens up (transformers' 2024 accumulation bug)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a leaf module: the data layer imports IGNORE_INDEX from it
    from trainmesh.training.engine import Criterion

IGNORE_INDEX = -100
"""The target of a token that is not trained (torch's ``ignore_index`` default)."""


def trained_count(targets: torch.Tensor) -> torch.Tensor:
    """How many of ``targets`` are trained, as a tensor (no host sync)."""
    return (targets != IGNORE_INDEX).sum()


def divisors(counts: Sequence[int], total: int, ranks: int) -> list[float]:
    """What each micro-batch's mean loss (over its ``counts[i]`` trained tokens) is divided by, given ``total``
    trained tokens in the global batch and ``ranks`` ranks whose gradients the engine averages: ``total /
    (count · ranks)``, so the ranks' mean gradient is that of the sum over all tokens over ``total``. Plain data
    gives exactly the micro-batch count (the old mean of means, bit for bit); no trained token gives ``inf``."""
    return [total / (n * ranks) if n else math.inf for n in counts]


def micro_loss(criterion: Criterion, out: torch.Tensor, targets: torch.Tensor, divisor: float) -> torch.Tensor:
    """``criterion``'s mean over the trained tokens divided by ``divisor``; with none trained (``inf``) a zero
    that still reaches every parameter, so backward and its gradient hooks run as on any micro-batch."""
    if math.isinf(divisor):
        return out.sum() * 0.0
    return criterion(out, targets) / divisor
