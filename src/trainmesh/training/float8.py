"""FP8 training of the linear layers through torchao's ``Float8Linear`` (``pip install 'trainmesh[fp8]'``).

State stays bf16 with fp32 masters; linear matmuls run in e4m3/e5m2 with dynamic per-tensor scales (Micikevicius et
al., "FP8 Formats for Deep Learning", 2022), as torchtitan does. ``high_precision`` layers, grouped experts and
dimensions not divisible by 16 stay bf16; names are kept, so checkpoints move between fp8 and bf16 runs."""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distributed.comm import Comm

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


def tp_scales(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], config, comm: Comm) -> list[torch.Tensor]:
    """The tensorwise scales of ``tensors`` (parts of tensors split over tp) as one process computes them for the
    whole tensors: each amax is the max over the tp group (one all-reduce for all of them)."""
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    amax = torch.stack([tensor_to_amax(t).double() for t in tensors])
    comm.all_reduce(amax, "tp", op="float8_amax", reduce_op=dist.ReduceOp.MAX)
    return [amax_to_scale(a, d, config.round_scales_to_power_of_2) for a, d in zip(amax, dtypes)]


def _to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, mm, role: str) -> torch.Tensor:
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    return hp_tensor_and_scale_to_float8(t, scale, dtype, mm, GemmInputRole(role))


class _GradToFloat8(torch.autograd.Function):
    """Identity forward; backward casts the output gradient (split over tp in a column shard) with the tp-wide
    scale, where one process's torchao matmul casts it with the whole gradient's."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, config, mm, comm: Comm) -> torch.Tensor:
        ctx.config, ctx.mm, ctx.comm = config, mm, comm
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype = ctx.config.cast_config_grad_output.target_dtype
        (scale,) = tp_scales([grad], [dtype], ctx.config, ctx.comm)
        return _to_float8(grad, scale, dtype, ctx.mm, "grad_output"), None, None, None


def _tp_float8_matmul(x: torch.Tensor, weight: torch.Tensor, config, mm, comm: Comm) -> torch.Tensor:
    """``x @ weight^T`` through torchao's float8 matmul, given operands it casts no further: input and weight cast
    with tp-wide scales here, the output gradient by :class:`_GradToFloat8` (the tensorwise recipe's casts)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    dtypes = (config.cast_config_input.target_dtype, config.cast_config_weight.target_dtype)
    x_scale, w_scale = tp_scales([x, weight], dtypes, config, comm)
    x8 = _to_float8(x, x_scale, dtypes[0], mm, "input")
    w8 = _to_float8(weight, w_scale, dtypes[1], mm, "weight")
    return _GradToFloat8.apply(matmul_with_hp_or_float8_args.apply(x8, w8.t(), mm, config), config, mm, comm)


def tp_float8_matmul(linear: nn.Module, shard: torch.Tensor,
                     comm: Comm) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The float8 matmul of a tensor-parallel ``shard`` of ``linear`` (torchao's ``Float8Linear``), whose scales
    equal one process's: None for a plain linear, or a shard not aligned for ``_scaled_mm`` (it stays bf16)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    if module is None or not isinstance(linear, module.Float8Linear) or any(n % ALIGNMENT for n in shard.shape):
        return None
    return functools.partial(_tp_float8_matmul, config=linear.config, mm=linear.linear_mm_config, comm=comm)
