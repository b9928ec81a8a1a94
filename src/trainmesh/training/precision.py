"""Mixed precision: low-precision compute with fp32 master weights, and dynamic loss scaling for fp16.

Following Micikevicius et al., "Mixed Precision Training" (ICLR 2018): the model's parameters and
activations are bf16 or fp16; the optimizer keeps an fp32 *master* copy of every parameter (or of its
shard, under ZeRO) and fp32 moments, updates the masters, and copies them back into the model. fp16's
narrow exponent range needs the loss scaled up before backward (§3.2); the scale halves whenever any
rank sees a non-finite gradient (the step is then skipped on every rank together) and doubles after
``growth_interval`` clean steps. bf16 has fp32's exponent range and needs no scaling.

fp64 is a full precision like fp32 (parameters are their own masters): slow, and no accelerator's tensor
cores run it, but its unit roundoff (1.1e-16) leaves the summation-order noise of a parallel layout far
below any real divergence, so the equivalence tests train in it and assert a bound tighter than any
machine's fp32 noise.

fp8 is bf16 mixed precision whose linear layers multiply in float8 (:mod:`trainmesh.training.float8`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    """The dtype a run in precision ``name`` holds its parameters and activations in: fp8 training keeps
    them bf16 and computes only the linears' matmuls in float8 (:mod:`trainmesh.training.float8`)."""
    return DTYPES[name]


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the optimizer, the norm and the loss work in: fp32 for low-precision training, else the
    parameters' own dtype (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def masters(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """fp32 copies of low-precision ``params`` for the optimizer to own; the model keeps the originals."""
    return [nn.Parameter(p.detach().to(master_dtype(p.dtype)).clone()) for p in params]


@torch.no_grad()
def copy_masters_to_model(masters: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    torch._foreach_copy_(list(params), list(masters))


class LossScaler:
    """Dynamic loss scale, identical on every rank because every rank sees the same overflow verdict."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000,
                 backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.backoff, self.growth, self.min_scale = growth_interval, backoff, growth, min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth

