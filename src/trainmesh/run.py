"""The :class:`Run`: what the training loop, checkpoints and benchmarks share of one built training run.

It sits below ``train`` and ``checkpoint`` so that both can name it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trainmesh.comm import Comm
from trainmesh.config import Config
from trainmesh.data import TokenData
from trainmesh.engine import Criterion, Engine
from trainmesh.mesh import Mesh
from trainmesh.pipeline.runtime import PipelineRuntime


@dataclass
class Run:
    """Everything a step needs, built once by :func:`trainmesh.train.build`."""

    cfg: Config
    mesh: Mesh
    comm: Comm
    model: nn.Module
    engine: Engine
    criterion: Criterion
    data: TokenData
    pipeline: PipelineRuntime | None = None  # pp > 1: runs this rank's stage(s); ``model`` is its part
