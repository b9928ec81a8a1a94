"""``trainmesh launch --nnodes MIN:MAX``: a run that goes on with the nodes that remain, under torch's elastic agent
(``elastic_launch``, as torchrun's c10d rendezvous). Each rank runs ``trainmesh train --elastic``, each round gets its
own store (:data:`FRESH_STORE_ENV`), and every port listens only on the named address (:func:`host_rendezvous`)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from trainmesh.distributed.mesh import bound_store

FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1, rank 0 of each rendezvous round hosts the round's store on a fresh port. Shared (torch's default),
the agents' store outlives the round, and a restarted rank could read the address a rank of the lost round
had published and fail to connect to it (seen on the test bed)."""
SNAPSHOT_DIR_ENV = "TRAINMESH_SNAPSHOT_DIR"
"""The node's directory of memory snapshots (``train --memory-snapshot``): in /dev/shm, so it outlives the ranks
the agent restarts; :func:`launch_elastic` makes one per agent and removes it when the agent ends."""
DEFAULT_MAX_RESTARTS = 3
RUN_COMMAND = "train"


@dataclass(frozen=True)
class ElasticNodes:
    """Between ``min_nodes`` and ``max_nodes`` nodes meeting at c10d rendezvous ``endpoint`` (HOST:PORT, hosted by
    that node's agent) as job ``run_id``, ranks restarted up to ``max_restarts`` times; ``rdzv_conf`` as torchrun's."""

    min_nodes: int
    max_nodes: int
    endpoint: str
    run_id: str
    max_restarts: int = DEFAULT_MAX_RESTARTS
    rdzv_conf: dict[str, str] = field(default_factory=dict)


def node_range(text: str) -> tuple[int, int] | None:
    """``--nnodes MIN:MAX`` as (MIN, MAX); None for a plain count. One line for a range that cannot work."""
    if ":" not in text:
        return None
    low, _, high = text.partition(":")
    if not (low.isdigit() and high.isdigit()):
        raise ValueError(f"--nnodes {text!r}: write the range as MIN:MAX, two whole numbers (e.g. 2:4)")
    if not 1 <= int(low) <= int(high):
        raise ValueError(f"--nnodes {text}: MIN must be at least 1 and at most MAX; e.g. --nnodes "
                         f"{max(1, min(int(low), int(high)))}:{max(1, int(low), int(high))}")
    return int(low), int(high)


def check_endpoint(endpoint: str) -> None:
    """One line unless ``endpoint`` is HOST:PORT with a port the rendezvous can listen on."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT, one node's address and a free port "
                         f"(1 to 65535) its agent listens on, the same on every node")


def rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf k=v,k=v`` as a dict, as torchrun reads it."""
    pairs = [item.partition("=") for item in text.split(",") if item]
    bad = next((key for key, eq, value in pairs if not (key and eq and value)), None)
    if bad is not None:
        raise ValueError(f"--rdzv-conf {text!r}: write key=value pairs separated by commas "
                         f"(e.g. join_timeout=600,last_call_timeout=30)")
    return {key: value for key, _, value in pairs}


def train_argv(command: str, args: Sequence[str]) -> list[str]:
    """The command every rank runs: ``train`` with ``--elastic`` (added once). Refused in one line for any
    other command: only ``train`` knows how to resume at another world size."""
    if command != RUN_COMMAND:
        raise ValueError(f"--nnodes MIN:MAX restarts `trainmesh train` on the nodes that remain, so it runs "
                         f"`train`, not {command!r}: write `trainmesh launch ... train --resume "
                         f"--checkpoint-dir DIR ...`; for a script of your own use torchrun --nnodes MIN:MAX")
    return [RUN_COMMAND, *([] if "--elastic" in args else ["--elastic"]), *args]


def host_rendezvous(nodes: ElasticNodes) -> dist.TCPStore | None:
    """The c10d rendezvous store, hosted on the endpoint's address alone where it is this machine's (torch's backend
    takes it over instead of listening everywhere); None where the address or port is another's, or ``is_host=0``."""
    if nodes.rdzv_conf.get("is_host", "1").lower() not in ("1", "true", "t", "yes", "y"):
        return None
    host, _, port = nodes.endpoint.rpartition(":")
    timeout = datetime.timedelta(seconds=int(nodes.rdzv_conf.get("read_timeout", "60")))
    try:
        return bound_store(host.strip("[]"), int(port), timeout, multi_tenant=True)
    except (OSError, RuntimeError):
        return None


def _loopback(host: str) -> bool:
    """Whether the endpoint is this host's loopback address, so every node of the run is on this host."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def die_with_agent() -> None:
    """In a rank of torch's elastic agent (torchrun, ``launch --nnodes MIN:MAX``): SIGKILL when the agent dies, as
    under trainmesh's launcher. A rank that outlived its agent went on training with nobody to restart it, and
    the survivors' agents then waited minutes for the lost agent at their exit barrier, saying nothing."""
    from trainmesh.distributed.launcher import _die_with_parent

    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_parent()
        if os.getppid() == 1:  # the agent died before the line above
            os._exit(1)


def _store_lost(nodes: ElasticNodes, argv: Sequence[str]) -> str:
    """The one line for a rendezvous store this node cannot reach: the node at the endpoint, whose agent hosts it,
    is gone (c10d's single point of failure) or was never started; what to run."""
    folder = next((argv[k + 1] for k, a in enumerate(argv[:-1]) if a == "--checkpoint-dir"), "--checkpoint-dir")
    return (f"trainmesh: the rendezvous store at {nodes.endpoint} (--rdzv-id {nodes.run_id}) cannot be reached: the "
            f"node at that address, whose agent hosts it, is gone or not started, and torch's c10d rendezvous has no "
            f"other copy (a single point of failure: docs/multinode.md); start that node's agent again, then this "
            f"node's, with the same command ({shlex.join(['trainmesh', *sys.argv[1:]])}): --resume continues from "
            f"the latest checkpoint in {folder}")


def _waits(nodes: ElasticNodes, hosting: bool) -> str:
    """The line saying what the agent waits for and for how long: the first meeting, and after a lost node
    (torch's c10d defaults where ``--rdzv-conf`` leaves them)."""
    conf = nodes.rdzv_conf
    where = "hosting the rendezvous store" if hosting else "joining the rendezvous store"
    return (f"trainmesh launch: {where} at {nodes.endpoint} (--rdzv-id {nodes.run_id}); waiting up to "
            f"{conf.get('join_timeout', '600')} s for at least {nodes.min_nodes} of {nodes.max_nodes} node(s) "
            f"(join_timeout), then {conf.get('last_call_timeout', '30')} s for late ones (last_call_timeout); a lost "
            f"node restarts the survivors, a lost store's host ends them")


def launch_elastic(argv: Sequence[str], nproc: int, nodes: ElasticNodes) -> int:
    """Run ``python -m trainmesh *argv`` as ``nproc`` ranks under torch's elastic agent, which meets the other nodes at
    ``nodes.endpoint`` and restarts the survivors when one is lost; returns the exit code, saying why a run failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainmesh.distributed.launcher import say

    os.environ[FRESH_STORE_ENV] = "1"
    if _loopback(nodes.endpoint.rpartition(":")[0].strip("[]")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every node on this host: Gloo on loopback too
    store = host_rendezvous(nodes)
    config = LaunchConfig(min_nodes=nodes.min_nodes, max_nodes=nodes.max_nodes, nproc_per_node=nproc,
                          run_id=nodes.run_id, rdzv_endpoint=nodes.endpoint, rdzv_backend="c10d",
                          rdzv_configs=dict(nodes.rdzv_conf), max_restarts=nodes.max_restarts,
                          local_addr=nodes.endpoint.rpartition(":")[0].strip("[]") if store else None)
    say(_waits(nodes, store is not None))
    snapshots = None if os.environ.get(SNAPSHOT_DIR_ENV) else f"/dev/shm/trainmesh-{nodes.run_id}-{os.getpid()}"
    if snapshots:
        os.environ[SNAPSHOT_DIR_ENV] = snapshots
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "trainmesh", *argv)  # unbuffered, as torchrun runs -m
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"killed by {failure.signal_name()}"
        say(f"trainmesh: rank {rank} failed ({how}) after {nodes.max_restarts} restart(s) of this node's ranks; "
            f"its traceback is above")
        return 1
    except RendezvousError as e:
        if isinstance(e, RendezvousConnectionError) and store is None:  # the store lived on another node
            say(_store_lost(nodes, argv))
            return 1
        say(f"trainmesh: the rendezvous at {nodes.endpoint} (--rdzv-id {nodes.run_id}) failed: "
            f"{type(e).__name__}: {e or 'timed out'}; are at least {nodes.min_nodes} nodes started with the same "
            f"--rdzv-endpoint and --rdzv-id?")
        return 1
    finally:
        if snapshots:
            shutil.rmtree(snapshots, ignore_errors=True)
    return 0
