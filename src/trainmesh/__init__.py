"""trainmesh: parallel forms applied to a plain ``nn.Module`` over a device mesh.

The public API (:mod:`trainmesh.api`): :func:`init_mesh`, :func:`parallelize`, :func:`optimizer`,
:func:`train_step`, :func:`save`, :func:`load`; :class:`StageLayout` names a model's blocks for the pipeline;
:mod:`trainmesh.models.tp_plans` (``tm.tp_plans``) holds tensor-parallel plans by model family; :class:`RunLog` writes a run directory
(metrics, summary, TensorBoard events) as ``trainmesh train`` does, for ``trainmesh report``;
:func:`register_family` adds a model family (a :class:`ModelSpec`, its planner view a :class:`ModelShape`)
that ``parallelize`` then recognises, without editing trainmesh.
"""

from importlib.metadata import PackageNotFoundError, version as _version

from trainmesh.quiet import quiet_dependencies

quiet_dependencies()  # before torchao or transformers is first imported, by trainmesh or the user's script

from trainmesh.models import tp_plans
from trainmesh.api import Optimizer, ParallelModel, init_mesh, load, optimizer, parallelize, save, train_step
from trainmesh.models import register_family
from trainmesh.models.spec import ModelShape, ModelSpec, StageLayout
from trainmesh.tracking.runlog import RunLog

try:
    __version__ = _version("trainmesh")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "init_mesh", "parallelize", "optimizer", "train_step", "save", "load", "StageLayout", "ParallelModel",
           "Optimizer", "tp_plans", "RunLog", "register_family", "ModelSpec", "ModelShape"]
