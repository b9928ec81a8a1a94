"""The :class:`Run`: what the training loop and checkpoints share of one built training run.

It sits below ``train`` and ``checkpoint`` so that both can name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.app.config import Config
from trainmesh.data import TokenData
from trainmesh.data.tokenizer import TokenizerFile
from trainmesh.training.engine import Criterion, Engine
from trainmesh.distributed.mesh import Mesh
from trainmesh.pipeline.runtime import PipelineRuntime

if TYPE_CHECKING:
    from trainmesh.api import Optimizer, ParallelModel


@dataclass
class Run:
    """Everything a step needs, built once by :func:`trainmesh.app.train.build`: the public API's parallel model
    and optimizer (what a script holds), the settings, the data and the tokenizer its ids come from."""

    cfg: Config
    parallel: ParallelModel
    opt: Optimizer
    data: TokenData
    tokenizer: TokenizerFile | None = None  # the run's tokenizer, pinned when it starts (None: byte tokens)

    @property
    def mesh(self) -> Mesh:
        return self.parallel.mesh

    @property
    def comm(self) -> Comm:
        return self.parallel.comm

    @property
    def model(self) -> nn.Module:
        """This rank's part of the model (its pipeline stage's blocks, its tensor-parallel shards)."""
        return self.parallel.module

    @property
    def engine(self) -> Engine:
        return self.parallel.engine

    @property
    def criterion(self) -> Criterion:
        return self.parallel.criterion

    @property
    def pipeline(self) -> PipelineRuntime | None:
        """pp > 1: runs this rank's stage(s)."""
        return self.parallel.pipeline
