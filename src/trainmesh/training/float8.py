"""FP8 training of the linear layers through torchao's ``Float8Linear`` (``pip install 'trainmesh[fp8]'``).

State stays bf16 with fp32 masters; linear matmuls run in e4m3/e5m2 with dynamic per-tensor scales (Micikevicius et
al., "FP8 Formats for Deep Learning", 2022), as torchtitan does. ``high_precision`` layers, grouped experts and
dimensions not divisible by 16 stay bf16; names are kept, so checkpoints move between fp8 and bf16 runs."""

from __future__ import annotations

import fnmatch
import importlib.util
from collections.abc import Sequence

import torch
from torch import nn

FP8_CAPABILITY = (8, 9)
"""The least CUDA compute capability with FP8 tensor cores (Ada Lovelace; Hopper is 9.0)."""

ALIGNMENT = 16
"""``torch._scaled_mm`` needs both dimensions of each operand divisible by 16."""

INSTALL_HINT = "pip install 'trainmesh[fp8]'"


def fp8_problem(capability: tuple[int, int] | None, option: str = "--precision fp8") -> str | None:
    """Why ``option`` cannot run here, or None: torchao missing, or a CUDA device of ``capability`` without
    FP8 tensor cores (None: the ranks run on CPU, where torchao's float8 runs)."""
    if importlib.util.find_spec("torchao") is None:
        return f"{option} computes linears through torchao's float8 training, which is not installed; {INSTALL_HINT}"
    if capability is not None and capability < FP8_CAPABILITY:
        major, minor = capability
        return (f"{option} needs FP8 tensor cores (compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+: "
                f"L4, L40S, H100, H200); this GPU is {major}.{minor}; use bf16")
    return None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None for a CPU."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _aligned(linear: nn.Linear) -> bool:
    return linear.in_features % ALIGNMENT == 0 and linear.out_features % ALIGNMENT == 0


def float8_targets(model: nn.Module, high_precision: Sequence[str]) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that compute in float8: every one not matched by a
    ``high_precision`` pattern (``fnmatch``, as tensor-parallel plans are) and aligned for ``_scaled_mm``."""
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and _aligned(module)
            and not any(fnmatch.fnmatchcase(name, pattern) for pattern in high_precision)]


def convert_to_float8(model: nn.Module, high_precision: Sequence[str]) -> list[str]:
    """Swap the linears :func:`float8_targets` names for torchao's ``Float8Linear`` (tensorwise dynamic
    scaling, its default recipe), in place; returns their names in model order."""
    from torchao.float8 import convert_to_float8_training

    targets = float8_targets(model, high_precision)
    convert_to_float8_training(model, module_filter_fn=lambda _module, name: name in targets)
    return targets
