"""FP8 training of the linear layers, through torchao's float8 training (``torchao.float8``).

Under ``precision="fp8"`` the parameters, activations and gradients stay bf16 and the optimizer keeps fp32
masters, exactly as under bf16; what changes is the matmuls of the linear layers: torchao's ``Float8Linear``
casts each one's input and weight to float8 e4m3 (and the output gradient to e5m2) with one dynamic scale
per tensor, multiplies with ``torch._scaled_mm`` and returns bf16 (Micikevicius et al., "FP8 Formats for
Deep Learning", 2022; torchtitan and Megatron-LM/Transformer Engine train so on Hopper). The layers whose
precision matters most stay bf16: the embedding, the output head and an MoE router, named per family
(:attr:`~trainmesh.models.spec.ModelSpec.high_precision`); so do the grouped MoE experts (not
``nn.Linear``) and any linear with a dimension not divisible by 16 (``_scaled_mm``'s alignment).

``Float8Linear`` keeps the ``nn.Linear``'s own ``weight`` and ``bias`` parameters under the same names, so
checkpoints, ZeRO's flat buffers and pipeline stages see the model they would see under bf16, and a
checkpoint written by an fp8 run loads into a bf16 run and back.

torchao is optional (``pip install 'trainmesh[fp8]'``) and imported only when fp8 is asked for. Checked
with torchao 0.18 on torch 2.13 (CPU build): ``torch._scaled_mm`` and ``Float8Linear``'s forward and
backward run on CPU too, so CPU runs take fp8 (slowly: a CPU has no float8 units); a CUDA device needs
FP8 tensor cores (compute capability 8.9: Ada, Hopper and later).
"""

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
