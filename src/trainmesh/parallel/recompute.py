"""Activation recomputation, applied to a plain model from outside: ``full`` recomputes whole blocks (Chen et al.,
2016), ``selective`` only the attention core, whose softmax grows with s² but is cheap to redo (Korthikanti et al.,
2022, §5). Targets come from ``ModelSpec.recompute``; ``forward`` is replaced on the instance, so names, hooks and
``state_dict`` are unchanged, and non-reentrant checkpointing recomputes after ZeRO-3's gather hooks."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainmesh.layout import RECOMPUTE

MODES = RECOMPUTE  # the layout names them once


Target = type[nn.Module] | str


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _is_target(module: nn.Module, targets: tuple[Target, ...]) -> bool:
    """A module of one of the classes, or whose class has one of the names (a class of a library that is
    imported only when the model is, such as ``transformers``' ``"LlamaDecoderLayer"``)."""
    names = {t for t in targets if isinstance(t, str)}
    return isinstance(module, tuple(t for t in targets if not isinstance(t, str))) or type(module).__name__ in names


def recompute_modules(model: nn.Module, targets: tuple[Target, ...]) -> int:
    """Checkpoint every module of ``model`` that is one of ``targets``; returns how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        if _is_target(module, targets):
            module.forward = _checkpointed(module.forward)
            wrapped += 1
    return wrapped


def apply_recompute(model: nn.Module, mode: str, targets: Mapping[str, tuple[Target, ...]]) -> int:
    """Checkpoint every module of the classes ``targets[mode]`` names (``full``: the blocks; ``selective``:
    the attention cores) in ``model``; returns how many modules were wrapped."""
    if mode not in MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return 0
    if not targets.get(mode):
        raise ValueError(f"recompute {mode!r} names no module class for this model; give targets[{mode!r}]")
    return recompute_modules(model, targets[mode])
