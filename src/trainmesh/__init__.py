"""trainmesh: parallel forms applied to a plain ``nn.Module`` over a device mesh.

The public API (:mod:`trainmesh.api`): :func:`init_mesh`, :func:`parallelize`, :func:`optimizer`,
:func:`train_step`, :func:`save`, :func:`load`; :class:`StageLayout` names a model's blocks for the pipeline;
:mod:`trainmesh.plans` holds tensor-parallel plans by model family.
"""

from trainmesh import plans
from trainmesh.api import Optimizer, ParallelModel, init_mesh, load, optimizer, parallelize, save, train_step
from trainmesh.models.spec import StageLayout

__all__ = ["init_mesh", "parallelize", "optimizer", "train_step", "save", "load", "StageLayout", "ParallelModel",
           "Optimizer", "plans"]
