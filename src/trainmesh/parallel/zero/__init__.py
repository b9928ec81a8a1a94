"""ZeRO (Rajbhandari et al., 2020, §5): data parallelism sharding the model state over ``dp``: AdamW state in stage 1
(:mod:`.stage1`), gradients too in stage 2 (:mod:`.stage2`), parameters too in stage 3 (:mod:`.stage3`), on a shared
:class:`~.engine.ZeroEngine`; :mod:`.formulas` states per-rank memory and traffic (§5, §7.2)."""

from __future__ import annotations

import torch
from torch import nn
from trainmesh.distributed.comm import Comm
from trainmesh.training.optim import OptimizerFactory
from trainmesh.parallel.data_parallel import DataParallel
from trainmesh.parallel.zero.base import DEFAULT_BUCKET_BYTES, ZeroEngine
from trainmesh.parallel.zero.flat import FlatLayout
from trainmesh.parallel.zero.formulas import model_state_bytes_formula, step_comm_bytes_formula
from trainmesh.parallel.zero.stage1 import ZeroStage1
from trainmesh.parallel.zero.stage2 import ZeroStage2
from trainmesh.parallel.zero.stage3 import ZeroStage3, default_units
from trainmesh.training.precision import LossScaler

__all__ = ["FlatLayout", "ZeroEngine", "ZeroStage1", "ZeroStage2", "ZeroStage3", "build_engine", "default_units",
           "model_state_bytes_formula", "step_comm_bytes_formula"]


def build_engine(module: nn.Module, comm: Comm, stage: int, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp") -> ZeroEngine | DataParallel:
    """The engine of ZeRO ``stage`` over ``axis`` (0: plain DP) with ``make_optimizer``'s optimizer over its shards
    (fp32 masters for 16-bit parameters); ``bucket_bytes`` applies to stages 0 to 2, stage 3 going unit by unit.
    The stage comes validated (:func:`trainmesh.layout.validate`, in ``parallelize``)."""
    engines = {0: DataParallel, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
    return engines[stage](module, comm, make_optimizer, bucket_bytes, reduce_dtype, scaler, axis)
