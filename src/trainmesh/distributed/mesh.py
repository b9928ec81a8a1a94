"""The device mesh: the world of ranks as named axes ``pp x dp x cp x tp``, one process group per axis.

``tp`` innermost (one node), then ``cp``, as Megatron-LM orders them; replicated gradients reduce over ``dp_cp``; ep
folds inside it (and tp under sp) as Megatron-core does. A single-process run builds no process group at all."""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainmesh.layout import Layout

AXES = ("pp", "dp", "cp", "tp")
GRAD_AXIS = "dp_cp"  # dp x cp flattened: where gradients of replicated parameters are reduced
EP_AXES = ("ep", "edp", "etp")  # inside dp_cp: expert-parallel ranks, ranks holding the same experts, expert-tp ranks
SHARD_AXIS, REPLICA_AXIS = "dp_shard", "dp_replicate"  # hybrid sharding: dp_cp = replica groups x shard ranks
HYBRID_AXES = (SHARD_AXIS, REPLICA_AXIS)
STORE_CLIENT_ENV = "TRAINMESH_STORE_CLIENT"


def pick_device(device: str) -> torch.device:
    """``auto`` means CUDA when present; a CUDA rank takes the GPU of its local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        local_rank = world_env().local_rank
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pick_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


@dataclass(frozen=True)
class WorldEnv:
    """Where this process sits in the job, as whoever started it said: ``env`` (torchrun, ``train --nproc``),
    ``slurm`` (one ``srun`` task per rank) or ``single`` (one process)."""

    source: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = ""  # slurm only; under ``env`` init_process_group reads MASTER_ADDR itself
    master_port: int = 0

    @property
    def is_rank(self) -> bool:
        """Started as one rank of a job (even of a world of one), not as the command that spawns them."""
        return self.source != "single"


def world_env(env: Mapping[str, str] = os.environ) -> WorldEnv:
    """This process's place in the job; torchrun's variables win over SLURM's (``srun ... torchrun`` sets both)."""
    if "RANK" in env:
        world = int(env.get("WORLD_SIZE", "1"))
        return WorldEnv("env", int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")),
                        int(env.get("LOCAL_WORLD_SIZE", str(world))))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return _slurm_world(env)
    return WorldEnv("single")


def _slurm_world(env: Mapping[str, str]) -> WorldEnv:
    """One rank per ``srun`` task; task 0 hosts the rendezvous at the step's first node (not the launch node,
    which may be a login node), on a port derived from the job id; ``MASTER_ADDR``/``MASTER_PORT`` override."""
    world = int(env["SLURM_NTASKS"])
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else env.get("SLURM_LAUNCH_NODE_IPADDR"))
    if not addr:
        raise RuntimeError("under srun, found neither SLURM_STEP_NODELIST/SLURM_JOB_NODELIST nor "
                           "SLURM_LAUNCH_NODE_IPADDR to find rank 0's host; set MASTER_ADDR to it")
    port = int(env.get("MASTER_PORT") or 15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return WorldEnv("slurm", int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", "0")),
                    _slurm_tasks_on_this_node(env, world), addr, port)


def _slurm_tasks_on_this_node(env: Mapping[str, str], world: int) -> int:
    """This node's task count from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 on each of the first 3
    nodes, 1 on the fourth) at ``SLURM_NODEID``; else ``SLURM_NTASKS_PER_NODE``; else an even split."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec and "SLURM_NODEID" in env:
        counts = []
        for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", spec):
            counts += [int(count)] * int(repeat or 1)
        return counts[int(env["SLURM_NODEID"])]
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_NTASKS_PER_NODE"])
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    return max(1, world // nodes)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``gpu[007-009,12],cpu1`` -> ``gpu007``, ``r[1-2]n[3-4]`` -> ``r1n3``
    (what ``scontrol show hostnames | head -1`` prints, without needing scontrol on the node)."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group(0)
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as set by ``trainmesh train --nproc``, ``torchrun`` or ``srun``; (0, 1) when unset."""
    world = world_env()
    return world.rank, world.world_size


def bound_store(addr: str, port: int, timeout: datetime.timedelta, **options: object) -> dist.TCPStore:
    """A TCPStore server listening on ``addr``'s interface alone (port 0: kernel's pick): TCPStore's own listens
    on every interface and is unauthenticated. ``options`` go to TCPStore."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(128)
        port = sock.getsockname()[1]
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                             timeout=timeout, **options)


def init_distributed(backend: str, device: torch.device, timeout_s: float = 300.0) -> None:
    """Join the process group described by the environment: as a client of the trainmesh launcher's store, or,
    under torchrun/srun with the round's own store, rank 0 hosting it on ``MASTER_ADDR``'s interface only."""
    world = world_env()
    if world.world_size == 1 or dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict = {"backend": backend, "rank": world.rank, "world_size": world.world_size, "timeout": timeout}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    addr, port = ((world.master_addr, world.master_port) if world.source == "slurm"
                  else (os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))))
    if os.environ.get(STORE_CLIENT_ENV) == "1" or (world.rank != 0 and addr and not agent_store):
        kwargs["store"] = dist.TCPStore(addr, port, world_size=world.world_size, is_master=False, timeout=timeout)
    elif world.rank == 0 and addr and not agent_store:
        kwargs["store"] = bound_store(addr, port, timeout, world_size=world.world_size)
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
    flat_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    timeout_s: float | None = None
    """What bounds a wait for another rank (``Mesh.build``'s ``timeout_s``; None: torch's default)."""
    sequence_parallel: bool = False
    """Whether tp ranks hold different slices of the sequence, so that ep folds over them too."""

    @classmethod
    def build(cls, pp: int, dp: int, tp: int, device: torch.device, timeout_s: float | None = None,
              cp: int = 1, ep: int = 1, dp_replicate: int = 1, sequence_parallel: bool = False,
              etp: int = 1) -> "Mesh":
        """The mesh over the current process group: ``timeout_s`` bounds every collective on every axis group;
        ``sequence_parallel`` folds ep over tp; ``dp_replicate`` > 1 splits ``dp_cp`` into contiguous ``dp_shard``
        groups."""
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp_replicate=dp_replicate,
                        sequence_parallel=sequence_parallel and tp > 1)  # validated by its callers
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, GRAD_AXIS: dp * cp, "ep": ep, "etp": etp,
                 "edp": layout.expert_data_ranks,
                 SHARD_AXIS: dp * cp // dp_replicate, REPLICA_AXIS: dp_replicate}
        world = pp * dp * cp * tp
        if world == 1:
            return cls(sizes, {a: 0 for a in (*AXES, GRAD_AXIS, *EP_AXES, *HYBRID_AXES)}, device)
        if not dist.is_initialized() or dist.get_world_size() != world:
            have = dist.get_world_size() if dist.is_initialized() else 1
            raise RuntimeError(f"mesh pp*dp*cp*tp={world} needs a process group of that size, have {have}")
        dm = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=AXES)
        if timeout_s is not None:
            for group in [dm.get_group(axis) for axis in AXES]:
                _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
        coords = dict(zip(AXES, dm.get_coordinate()))
        coords[GRAD_AXIS] = coords["dp"] * cp + coords["cp"]
        token = coords[GRAD_AXIS] * tp + coords["tp"] if layout.experts_over_tp else coords[GRAD_AXIS]
        coords["etp"], coords["ep"], coords["edp"] = token % etp, token // etp % ep, token // (etp * ep)
        coords[REPLICA_AXIS], coords[SHARD_AXIS] = divmod(coords[GRAD_AXIS], sizes[SHARD_AXIS])
        mesh = cls(sizes, coords, device, dm, timeout_s=timeout_s, sequence_parallel=layout.sequence_parallel)
        if cp > 1:
            mesh.flat_groups.update(mesh._grad_groups(timeout_s))
        if ep * etp > 1:
            mesh.flat_groups.update(mesh._expert_groups(timeout_s))
        if dp_replicate > 1:
            mesh.flat_groups.update(mesh._hybrid_groups(timeout_s))
        return mesh

    def _grad_groups(self, timeout_s: float | None) -> dict[str, dist.ProcessGroup]:
        """This rank's ``dp_cp`` group (the ranks sharing its ``pp`` and ``tp`` coordinates), built with the public
        ``new_group`` on every rank in one order rather than the private ``DeviceMesh._flatten``."""
        return self._split_ranks(timeout_s, (GRAD_AXIS,), self._grad_axes(), lambda ranks: {GRAD_AXIS: [ranks]})

    def _expert_groups(self, timeout_s: float | None) -> dict[str, dist.ProcessGroup]:
        """This rank's ``etp``, ``ep`` and ``edp`` groups over the token ranks (:meth:`_token_ranks`) taken as
        ``[edp, ep, etp]``, etp innermost (Megatron-core's expert order): its runs of etp consecutive ranks, the ranks
        etp apart inside a run of ``ep * etp``, and the ranks at the same place of every such run."""
        etp, ep, edp = self.sizes["etp"], self.sizes["ep"], self.sizes["edp"]
        token_ranks = [ranks for pp in range(self.sizes["pp"]) for ranks in self._token_ranks(pp)]

        def at(ranks: list[int], e: int, r: int, t: int) -> int:
            return ranks[(e * ep + r) * etp + t]
        return self._split_ranks(timeout_s, EP_AXES, token_ranks, lambda ranks: {
            "etp": [[at(ranks, e, r, t) for t in range(etp)] for e in range(edp) for r in range(ep)],
            "ep": [[at(ranks, e, r, t) for r in range(ep)] for e in range(edp) for t in range(etp)],
            "edp": [[at(ranks, e, r, t) for e in range(edp)] for r in range(ep) for t in range(etp)]})

    def _token_ranks(self, pp: int) -> list[list[int]]:
        """The global ranks of stage ``pp`` that hold different tokens, one list per set of them: each tp
        coordinate's ``dp_cp`` axis, or under sequence parallelism all of them at once, tp innermost."""
        tp = self.sizes["tp"]
        if self.sequence_parallel:
            return [[r for c in zip(*(self._grad_axis_ranks(pp, t) for t in range(tp))) for r in c]]
        return [self._grad_axis_ranks(pp, t) for t in range(tp)]

    def _hybrid_groups(self, timeout_s: float | None) -> dict[str, dist.ProcessGroup]:
        """This rank's ``dp_shard`` group (the ``dp_cp`` coordinates ``[rS, (r+1)S)`` of replica ``r``) and its
        ``dp_replicate`` group (coordinate ``s`` of every replica)."""
        shard, replicas = self.sizes[SHARD_AXIS], self.sizes[REPLICA_AXIS]
        return self._split_ranks(timeout_s, HYBRID_AXES, self._grad_axes(), lambda ranks: {
            SHARD_AXIS: [ranks[r * shard:(r + 1) * shard] for r in range(replicas)],
            REPLICA_AXIS: [ranks[s::shard] for s in range(shard)]})

    def _grad_axes(self) -> list[list[int]]:
        """The global ranks of every ``dp_cp`` axis, one per (pp, tp) coordinate."""
        return [self._grad_axis_ranks(pp, tp) for pp in range(self.sizes["pp"]) for tp in range(self.sizes["tp"])]

    def _split_ranks(self, timeout_s: float | None, axes: tuple[str, ...], rank_sets: list[list[int]],
                     split: Callable[[list[int]], dict[str, list[list[int]]]]) -> dict[str, dist.ProcessGroup]:
        """This rank's group on each of ``axes`` above size 1, ``split`` dividing ``rank_sets`` into that axis's
        groups; every rank creates every group in one order (``new_group`` is collective)."""
        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        mine = {}
        for ranks in rank_sets:
            groups = split(ranks)
            for axis in axes:
                if self.sizes[axis] == 1:
                    continue
                for members in groups[axis]:
                    group = dist.new_group(members, **kwargs)
                    if dist.get_rank() in members:
                        mine[axis] = group
        return mine

    def _grad_axis_ranks(self, pp: int, tp: int) -> list[int]:
        """Global ranks of the ``dp_cp`` axis at (``pp``, ``tp``), indexed by their ``dp_cp`` coordinate."""
        cp = self.sizes["cp"]
        return [self.global_rank(pp=pp, tp=tp, dp=c // cp, cp=c % cp) for c in range(self.sizes[GRAD_AXIS])]

    @property
    def experts_over_tp(self) -> bool:
        """Whether the ep groups fold over tp (:attr:`trainmesh.layout.Layout.experts_over_tp`)."""
        return Layout(tp=self.size("tp"), ep=self.size("ep"), etp=self.size("etp"),
                      sequence_parallel=self.sequence_parallel).experts_over_tp

    def size(self, axis: str) -> int:
        """The size of ``axis``; a mesh built without expert parallelism has ``ep`` 1, one without hybrid
        sharding ``dp_replicate`` 1 (and ``dp_shard`` the whole ``dp_cp`` axis)."""
        if axis == SHARD_AXIS:
            return self.sizes.get(axis, self.sizes.get(GRAD_AXIS, self.sizes["dp"] * self.sizes["cp"]))
        return self.sizes.get(axis, 1) if axis in (*EP_AXES, REPLICA_AXIS) else self.sizes[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        if axis == SHARD_AXIS and axis not in self.coords:
            return self.coords.get(GRAD_AXIS, self.coords["dp"] * self.sizes["cp"] + self.coords["cp"])
        return self.coords.get(axis, 0) if axis in (*EP_AXES, REPLICA_AXIS) else self.coords[axis]

    def groups(self) -> list[dist.ProcessGroup]:
        """This rank's groups, one per axis of size above 1, in the same axis order on every rank (a
        collective over each in turn cannot deadlock: every rank is in exactly one group of each axis)."""
        groups = [self.group(axis) for axis in (*AXES, GRAD_AXIS, *EP_AXES, *HYBRID_AXES)]
        return list(dict.fromkeys(g for g in groups if g is not None))

    def group(self, axis: str) -> dist.ProcessGroup | None:
        if self.device_mesh is None or self.size(axis) == 1:
            return None
        if axis == GRAD_AXIS or (axis == "edp" and self.size("ep") * self.size("etp") == 1) or (
                axis == SHARD_AXIS and self.size(REPLICA_AXIS) == 1):
            return self.flat_groups.get(GRAD_AXIS) or self.device_mesh.get_group("dp")
        if axis in (*EP_AXES, *HYBRID_AXES):
            return self.flat_groups[axis]
        return self.device_mesh.get_group(axis)

    def global_rank(self, **coords: int) -> int:
        """Global rank of the mesh point that differs from this rank in the given coordinates."""
        point = {**self.coords, **coords}
        return ((point["pp"] * self.sizes["dp"] + point["dp"]) * self.sizes["cp"] + point["cp"]) * self.sizes["tp"] \
            + point["tp"]

    @property
    def world_size(self) -> int:
        return self.sizes["pp"] * self.sizes["dp"] * self.sizes["cp"] * self.sizes["tp"]


EXIT_WAIT_S = 60.0
_uncaught: list[BaseException] = []


def leave_at_exit(mesh: Mesh) -> None:
    """Leave the process group when the interpreter exits, if the script has not (:func:`_leave`)."""
    _record_uncaught_exceptions()
    atexit.register(_leave, mesh)


def _leave(mesh: Mesh) -> None:
    """Wait for every rank's collectives, then destroy the process group and its Gloo groups while the interpreter is
    whole; a rank ending by an uncaught exception waits for nobody and exits 1, so teardown cannot hide the failure."""
    joined = dist.is_initialized()  # not if the script, or another mesh's exit handler, destroyed the group
    if joined:
        if dist.get_backend() == "gloo" and not _uncaught:
            _finish_collectives(mesh)
        dist.destroy_process_group()
    _release_groups(mesh)
    if joined and os.environ.get(STORE_CLIENT_ENV) == "1" and any(isinstance(e, Exception) for e in _uncaught):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _finish_collectives(mesh: Mesh) -> None:
    """Return once every rank finished the collectives queued on every mesh group (Gloo's barrier follows
    earlier work), after a world barrier bounded by :data:`EXIT_WAIT_S` so departed peers are not awaited."""
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_WAIT_S))
        for group in [None, *mesh.groups()]:
            dist.barrier(group=group)
    except RuntimeError:
        pass  # a peer left first: it has no collective of this rank's to finish


def _release_groups(mesh: Mesh) -> None:
    """Let go of the mesh's process groups so each Gloo group is destroyed now, its workers joined: left to
    interpreter teardown, a worker needing the GIL makes the rank abort or hang."""
    mesh.device_mesh = None
    mesh.flat_groups.clear()
    gc.collect()


@functools.cache
def _record_uncaught_exceptions() -> None:
    hook = sys.excepthook

    def record(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _uncaught.append(value)
        hook(kind, value, tb)

    sys.excepthook = record


def shutdown_distributed() -> None:
    """Leave the process group now, for a process whose exit runs no ``atexit`` handler (a multiprocessing
    child ends by ``os._exit``), so :func:`leave_at_exit` would not."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
