"""A rank's exit (the handler ``api.init_mesh`` registers): every rank's collectives finish, the process group
is destroyed, and every Gloo group ends with its worker threads before the interpreter's teardown, where a
worker thread still freeing a tensor cannot get the GIL (an abort, or a hang in the join that kept the
elastic test bed's agents waiting)."""

import os
import weakref

import torch
import torch.distributed as dist

import trainmesh as tm
from trainmesh.distributed import mesh as mesh_module
from trainmesh.distributed.testing import run_ranks


def _gloo_threads() -> list[str]:
    names = (open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
    return [name for name in names if "gloo" in name]


def _exchange(mesh: mesh_module.Mesh) -> None:
    """Collectives on every group, whose tensors Python lets go as soon as each is waited for."""
    for i in range(20):
        for group in [None, *mesh.groups()]:
            dist.all_reduce(torch.ones(100, dtype=torch.float64) * i, group=group, async_op=True).wait()


def _leave_after_collectives(dp: int, tp: int) -> tuple[bool, int, list[str]]:
    mesh = tm.init_mesh(dp=dp, tp=tp)
    world = weakref.ref(dist.group.WORLD)
    _exchange(mesh)
    running = len(_gloo_threads())
    mesh_module._leave(mesh)
    return world() is None, running, _gloo_threads()


def test_leaving_ends_every_gloo_group_and_its_worker_threads_before_the_interpreter_goes():
    for ended, running, left in run_ranks(_leave_after_collectives, 2, 1, 2, timeout=120):
        assert running > 0  # the groups had threads to end
        assert ended and left == [], (ended, left)
