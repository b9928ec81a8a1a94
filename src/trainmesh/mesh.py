"""The device mesh: the world of ranks viewed as named axes ``pp x dp x tp``, one process group per axis.

``tp`` is innermost so that a tensor-parallel group is made of consecutive ranks (on a GPU cluster: one
node, where the bandwidth that tensor parallelism needs is), as Megatron-LM orders its groups.
A single-process run builds no process group at all: every axis has size 1 and the collectives in
:mod:`trainmesh.comm` are skipped, so the same code path serves one rank and many.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "tp")
STORE_CLIENT_ENV = "TRAINMESH_STORE_CLIENT"


def pick_device(device: str) -> torch.device:
    """``auto`` means CUDA when present; a CUDA rank takes the GPU of its local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pick_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as set by ``trainmesh train --nproc`` or ``torchrun``; (0, 1) when unset."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str, device: torch.device, timeout_s: float = 300.0) -> None:
    """Join the process group described by the environment.

    Ranks spawned by the trainmesh launcher are all *clients* of a store the launcher hosts on
    127.0.0.1, so no rank opens a rendezvous port of its own. Under torchrun the usual ``env://``
    rendezvous applies.
    """
    rank, world = world_from_env()
    if world == 1 or dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict = {"backend": backend, "rank": rank, "world_size": world, "timeout": timeout}
    if os.environ.get(STORE_CLIENT_ENV) == "1":
        kwargs["store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                        world_size=world, is_master=False, timeout=timeout)
    else:
        kwargs["init_method"] = "env://"
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)


@dataclass
class Mesh:
    """Sizes and coordinates of this rank on each axis, and the axis process groups."""

    sizes: dict[str, int]
    coords: dict[str, int]
    device: torch.device
    device_mesh: DeviceMesh | None = None

    @classmethod
    def build(cls, pp: int, dp: int, tp: int, device: torch.device, timeout_s: float | None = None) -> "Mesh":
        """The mesh over the current process group; ``timeout_s`` bounds every collective on every axis.

        ``init_device_mesh`` gives its sub-groups torch's default timeout (30 minutes on Gloo) whatever the
        world group's is, so the timeout is set on each axis group afterwards.
        """
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        world = pp * dp * tp
        if world == 1:
            return cls(sizes, {a: 0 for a in AXES}, device)
        if not dist.is_initialized() or dist.get_world_size() != world:
            have = dist.get_world_size() if dist.is_initialized() else 1
            raise RuntimeError(f"mesh pp*dp*tp={world} needs a process group of that size, have {have}")
        dm = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=AXES)
        if timeout_s is not None:
            for axis in AXES:
                _set_pg_timeout(datetime.timedelta(seconds=timeout_s), dm.get_group(axis))
        coords = dict(zip(AXES, dm.get_coordinate()))
        return cls(sizes, coords, device, dm)

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.coords[axis]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        if self.device_mesh is None or self.sizes[axis] == 1:
            return None
        return self.device_mesh.get_group(axis)

    def global_rank(self, **coords: int) -> int:
        """Global rank of the mesh point that differs from this rank in the given coordinates."""
        point = {**self.coords, **coords}
        return (point["pp"] * self.sizes["dp"] + point["dp"]) * self.sizes["tp"] + point["tp"]

    @property
    def world_size(self) -> int:
        return self.sizes["pp"] * self.sizes["dp"] * self.sizes["tp"]


def shutdown_distributed() -> None:
    """Leave the process group cleanly; a rank that exits holding it can abort in Gloo's destructors."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
