"""Replica groups that keep training while one is lost, through torchft (the ``ft`` extra).

Each trainmesh world (its ranks data-parallel or ZeRO-sharded, any layout inside) is one replica group of a
torchft job: the lighthouse forms a quorum of the groups alive before every step, the group's Manager averages
the step's reduced gradients over them through a Gloo (or NCCL) group rebuilt for each quorum, and a group that
joins or rejoins copies a live peer's state before its forward. The equivalence this keeps: every committed step
is one process's step on the batches the groups of its quorum consumed. How to run it: docs/multinode.md."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.api import Optimizer, ParallelModel
from trainmesh.checkpoint.store import local_state
from trainmesh.distributed.mesh import REPLICA_AXIS


def _torchft() -> ModuleType:
    """torchft, imported on first use so that the core trains without it; its servers log every quorum at INFO
    unless ``RUST_LOG`` says otherwise."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise ImportError("replica groups that keep training need torchft; install it with "
                          "pip install 'trainmesh[ft]'") from None
    return torchft


def lighthouse(min_replicas: int = 1, port: int = 0, heartbeat_timeout_s: float = 1.0,
               join_timeout_s: float = 1.0) -> Any:
    """Start torchft's lighthouse in this process (its ``address()`` is what each group's :class:`ReplicaGroup`
    takes; ``torchft_lighthouse`` starts one as a command). A group whose heartbeats stop for
    ``heartbeat_timeout_s`` leaves the next quorum; a new quorum waits ``join_timeout_s`` for late groups."""
    _torchft()
    from torchft.coordination import LighthouseServer
    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas,
                            join_timeout_ms=int(join_timeout_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


class ReplicaGroup:
    """This world as replica group ``replica`` of the torchft job whose lighthouse is at ``lighthouse``.

    Call :meth:`start_step` before each :func:`trainmesh.train_step`: it joins the step's quorum (a group that
    (re)joins copies a live peer's parameters and optimizer state there) and returns the step to train, the
    same on every group alive. The engine then averages its gradients over the quorum's groups and updates only
    if torchft commits the step (a failed one returns a NaN norm and is trained again on the next call).
    ``host``: the name or address the other groups reach this one at (default: this machine's host name);
    ``timeout_s`` bounds every torchft wait (quorum, collectives, the heal's transfer); ``step``: where this
    group's own state stands (a resumed checkpoint's step), which a group further behind heals past."""

    def __init__(self, model: ParallelModel, opt: Optimizer, lighthouse: str, replica: int, *,
                 min_replicas: int = 1, timeout_s: float = 10.0, host: str | None = None, step: int = 0) -> None:
        ft = _torchft()
        if opt.engine is not model.engine or model.engine is None:
            raise ValueError("pass the model and the optimizer trainmesh.optimizer(model) returned for it")
        if model.mesh.size(REPLICA_AXIS) > 1:
            raise ValueError(f"this world already splits into dp_replicate={model.mesh.size(REPLICA_AXIS)} replica "
                             f"groups; under torchft each world is one replica group: drop dp_replicate")
        self.model = model
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        host = host or socket.gethostname()
        self._store, port = _group_store(host, rank, world)
        timeout = timedelta(seconds=timeout_s)
        pg = ft.ProcessGroupGloo(timeout=timeout) if model.mesh.device.type == "cpu" else ft.ProcessGroupNCCL(
            timeout=timeout)
        self.manager = ft.Manager(pg=pg, load_state_dict=self._load, state_dict=self._state,
                                  min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
                                  quorum_timeout=timeout, connect_timeout=timeout, rank=rank, world_size=world,
                                  store_addr=host, store_port=port, lighthouse_addr=lighthouse,
                                  replica_id=f"replica{replica}", hostname=host)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        model.engine.replica_sync = self._sync

    def start_step(self) -> int:
        """Join this step's quorum, healing from a live peer if this group is behind; returns the step to train."""
        self.manager.start_quorum()
        return self.manager.current_step()

    def steps(self, stop: int) -> Iterator[int]:
        """The step to train next (:meth:`start_step`) until ``stop``; a step given up comes again."""
        while (step := self.start_step()) < stop:
            yield step

    def committed(self, step: int) -> bool:
        """Whether ``step``, just trained, was committed (else it is trained again on the next quorum)."""
        return self.manager.current_step() == step + 1

    @property
    def participants(self) -> int:
        """Replica groups whose gradients the current step averages."""
        return self.manager.num_participants()

    def close(self) -> None:
        """Stop this group's torchft servers (the others go on without it)."""
        self.model.engine.replica_sync = None
        self.manager.shutdown(wait=False)

    def _sync(self, grads: list[torch.Tensor]) -> bool:
        """The engine's hook: average the group-reduced ``grads`` over the quorum in place; whether to update."""
        works = [self.manager.allreduce(g) for g in grads]
        for work in works:
            work.wait()
        return self.manager.should_commit()

    def _state(self) -> dict[str, dict[str, torch.Tensor]]:
        """What a peer that heals from this rank copies: its shard of the parameters and optimizer state, as the
        checkpoints hold them, and its module's tensors that it holds (copies: the step goes on while it reads)."""
        return {"shards": {t.name: t.views[0].detach().clone()
                           for t in local_state(self.model.module, self.model.engine)},
                "module": {k: v.detach().clone() for k, v in _held(self.model.module).items()}}

    def _load(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take the state of the peer group's rank that holds what this rank holds (same layout). torchft heals
        rank by rank, so this rank's group peers may not heal with it: the module's own tensors are copied too,
        rather than gathered from the shards through a collective they would not join."""
        for t in local_state(self.model.module, self.model.engine):
            for view in t.views:
                view.copy_(state["shards"][t.name])
        with torch.no_grad():
            for k, v in _held(self.model.module).items():
                v.copy_(state["module"][k])


def _held(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s tensors whose memory this rank holds now (ZeRO-3 frees the storage of the parameters it
    gathers only for compute; their shards travel in the optimizer's state)."""
    return {k: v for k, v in module.state_dict().items() if v.untyped_storage().nbytes() > 0}


def _group_store(host: str, rank: int, world: int) -> tuple[dist.TCPStore | None, int]:
    """The store torchft meets in: this group's ranks, and the groups a quorum joins, in the store of its group
    with the newest state. So the group's first rank hosts one at ``host``, which the other groups reach (a
    world's own store may listen on 127.0.0.1 only); returns it (None on the other ranks) and its port."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    if world > 1:
        dist.broadcast_object_list(port, src=0)
    return store, port[0]
