"""Mixed precision (Micikevicius et al., ICLR 2018): bf16/fp16 compute with fp32 masters and moments, and dynamic loss
scaling for fp16 (§3.2), halved on a non-finite gradient on any rank, doubled after ``growth_interval`` clean steps.
fp64 is a full precision for the equivalence tests; fp8 is bf16 with float8 linears (:mod:`.float8`)."""

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

