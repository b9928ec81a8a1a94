"""Bytes per element of each kind of model state by precision, and which ones each ZeRO stage shards
[ZeRO, sec. 3.1 and 5]; standard library only, so the planner and the engines share it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TypeVar

Count = TypeVar("Count", int, float)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each state; ``optimizer`` is the ZeRO paper's K [ZeRO, sec. 3.1]."""

    param: int
    grad: int
    optimizer: int
    activation: int


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 1}
FULL_PRECISIONS = ("fp32", "fp64")  # parameters are their own master weights
STORED_AS = {"fp8": "bf16"}
"""Precisions whose parameters and saved activations are held in another dtype: fp8 training keeps bf16
weights and saves each linear's bf16 input for backward (torchao's ``Float8Linear``), casting to float8
only inside the matmul, so its model state and activations cost bf16's (Micikevicius et al. 2022, sec. 4)."""
STEP_SCALAR_BYTES = 4  # AdamW keeps one float32 ``step`` tensor per parameter tensor.


@functools.cache
def precision_bytes(precision: str, reduce_dtype: str) -> Precision:
    """Parameters and activations in ``precision``, gradients in ``reduce_dtype``: K = 8 in fp32 (16 in fp64),
    12 with fp32 masters [ZeRO, 3.1]; fp32 gradient reduction holds 4 Psi (Megatron's ``main_grad``); fp8
    costs what bf16 does."""
    size = DTYPE_BYTES[STORED_AS.get(precision, precision)]
    return Precision(size, DTYPE_BYTES[reduce_dtype], 2 * size if precision in FULL_PRECISIONS else 12, size)


def sharded_state_bytes(full: Count, shard: Count, stage: int, b: Precision) -> tuple[Count, Count, Count]:
    """(params, grads, optimizer) bytes of a rank with ``full`` elements and ``shard`` of them its ZeRO shard [ZeRO,
    sec. 5, Fig. 1]: stage 1 shards the optimizer state, 2 also gradients, 3 also parameters."""
    return (b.param * (shard if stage >= 3 else full), b.grad * (shard if stage >= 2 else full),
            b.optimizer * (shard if stage >= 1 else full))
