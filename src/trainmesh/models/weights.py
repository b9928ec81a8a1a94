"""Initial weights a model can train from: floating point and finite. Loaded tensors are cast into the
parameters, so integer tensors or a NaN/inf would train garbage (``loss nan``, exit 0); both are refused
before training, naming the tensor."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import safetensors
import torch

FLOATING = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
"""The safetensors dtypes of initial weights, with their torch dtypes (float8 needs scales trainmesh does not
read, so it is refused with the integers)."""


def header_dtype_problem(name: str, dtype: str) -> str | None:
    """Why a tensor whose safetensors header says ``dtype`` (``F32``, ``U8``, ...) cannot start training."""
    if dtype in FLOATING:
        return None
    return (f"tensor {name} is {dtype}; initial weights must be floating point ({', '.join(FLOATING)}): convert "
            f"the weights, e.g. model.float().save_pretrained(DIR)")


def untrainable(name: str, tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot start training (not floating point, or holding NaN/inf), or None. A meta tensor
    (a header read without its data) is checked for its dtype only."""
    if tensor.dtype not in FLOATING.values():
        return (f"tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; initial weights must be floating "
                f"point (float16, bfloat16, float32 or float64)")
    if tensor.is_meta:
        return None
    bad = tensor.numel() - int(torch.isfinite(tensor).sum())
    if bad:
        return (f"tensor {name} holds {bad:,} non-finite value(s) (NaN or inf) among {tensor.numel():,}; a model "
                f"started from them trains to NaN: use weights saved before they diverged")
    return None


def first_untrainable(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The problem of the first tensor that cannot start training, in order, or None."""
    return next((problem for name, t in tensors if (problem := untrainable(name, t))), None)


def scan_file(path: Path) -> str | None:
    """:func:`first_untrainable` over a safetensors file, one tensor in memory at a time (a model larger than
    memory can be checked before any rank loads its share)."""
    with safetensors.safe_open(path, framework="pt") as f:
        for name in f.keys():
            if problem := header_dtype_problem(name, f.get_slice(name).get_dtype()):
                return problem
        return first_untrainable((name, f.get_tensor(name)) for name in f.keys())
