"""trainmesh: parallel forms applied to a plain ``nn.Module`` over a device mesh. The public API is :mod:`trainmesh.api`;
names are imported on first use (PEP 562), so the command line can speak before torch is imported."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version

from trainmesh.tracking.quiet import quiet_dependencies

quiet_dependencies()  # before torchao or transformers is first imported, by trainmesh or the user's script

try:
    __version__ = _version("trainmesh")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_HOMES = {"init_mesh": "trainmesh.api", "parallelize": "trainmesh.api", "optimizer": "trainmesh.api",
          "train_step": "trainmesh.api", "save": "trainmesh.api", "load": "trainmesh.api",
          "ParallelModel": "trainmesh.api", "Optimizer": "trainmesh.api",
          "StageLayout": "trainmesh.models.spec", "ModelSpec": "trainmesh.models.spec",
          "ModelShape": "trainmesh.models.spec", "register_family": "trainmesh.models",
          "RunLog": "trainmesh.tracking.runlog", "from_hf": "trainmesh.models.hf", "tp_plans": "trainmesh.models.tp_plans"}  # a module itself

__all__ = ["__version__", "init_mesh", "parallelize", "optimizer", "train_step", "save", "load", "StageLayout",
           "ParallelModel", "Optimizer", "tp_plans", "RunLog", "register_family", "ModelSpec", "ModelShape",
           "from_hf"]


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'trainmesh' has no attribute {name!r}")
    home = import_module(_HOMES[name])
    value = home if home.__name__.endswith("." + name) else getattr(home, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
