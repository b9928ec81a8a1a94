"""Activation recomputation (checkpointing), applied to a plain model from outside.

``full`` keeps only each transformer block's input and recomputes the block in backward (Chen et al.,
2016); ``selective`` recomputes only the attention core, whose saved softmax is the part of the
activations that grows with sequence length squared while costing few FLOPs to redo (Korthikanti et al.,
2022, §5). The modules' ``forward`` is replaced on the instance, so parameter names, hooks registered on
the modules (ZeRO-3's gather/free) and ``state_dict`` are unchanged; non-reentrant checkpointing runs the
recomputation inside backward, after the hooks that gather a unit's parameters for its backward.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainmesh.models.gpt import AttentionCore, Block

MODES = ("none", "selective", "full")


def _checkpointed(forward: Callable) -> Callable:
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False)

    return run


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Checkpoint every :class:`Block` (``full``) or :class:`AttentionCore` (``selective``) in ``model``;
    returns how many modules were wrapped."""
    if mode not in MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; choose one of {', '.join(MODES)}")
    target = {"none": None, "selective": AttentionCore, "full": Block}[mode]
    wrapped = 0
    for module in model.modules():
        if target is not None and isinstance(module, target):
            module.forward = _checkpointed(module.forward)
            wrapped += 1
    return wrapped
