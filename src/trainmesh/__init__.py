"""trainmesh: parallel forms applied to a plain ``nn.Module`` over a device mesh."""

from trainmesh.tensor_parallel import parallelize

__all__ = ["parallelize"]
