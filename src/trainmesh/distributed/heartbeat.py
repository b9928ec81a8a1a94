"""Heartbeats and the peer watchdog: every rank writes ``time progress waiting host`` into the run's store every
HEARTBEAT_S and reads its peers', so a dead, stopped or frozen rank is declared within ``--peer-timeout`` seconds
under any launcher (trainmesh's, torchrun's elastic agent, srun) instead of after a collective timeout.

Two symptoms, told apart: a heartbeat that stops changing (the process is gone, SIGSTOPped, or holds the GIL in
a native call) and a heartbeat that goes on while the rank's progress counter (waits finished) stands still
and it waits for nothing inside a training step, while this rank waits (a busy loop that no longer calls collectives). Ages are
measured on the reader's own clock, from when a peer's value last changed, so hosts need no common clock."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from trainmesh.distributed.mesh import STORE_CLIENT_ENV, world_env

HEARTBEAT_S = 0.5
HEARTBEAT_STALE_S = 3.0  # a running rank's heartbeat thread writes every HEARTBEAT_S; this late, it is frozen
PEER_TIMEOUT_S = 10.0  # default of --peer-timeout
HEARTBEAT_KEY = "trainmesh/heartbeat/{rank}"
"""Not per elastic round: nodes count their agent's restarts apart (a node restarted for a new member does not
count it), and a key a lost round left in a shared store is overwritten within a beat of its rank starting."""
STOPPED_KEY = "trainmesh/stopped/{rank}"  # set by trainmesh's launcher while a rank is stopped: its grace rules
DONE = "done"  # a rank's last beat as it exits
PEER_LOST_EXIT = 75
"""A rank's exit code when its watchdog declared a peer lost: a failure the launcher or agent restarts from."""


def heartbeat_key(rank: int) -> str:
    return HEARTBEAT_KEY.format(rank=rank)


@dataclass
class Progress:
    """What this rank's heartbeat carries besides the time: waits finished (the progress counter), when the
    current wait began (None: computing) and the seconds spent waiting so far (for the straggler split)."""

    count: int = 0
    waiting_since: float | None = None
    waited_s: float = 0.0
    depth: int = 0
    stepping: bool = False


PROGRESS = Progress()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around every blocking wait for a peer (a collective, a message, a shared-memory semaphore): counts the
    seconds as waiting and the end as progress; nested waits count once."""
    p = PROGRESS
    p.depth += 1
    if p.depth == 1:
        p.waiting_since = time.monotonic()
    try:
        yield
    finally:
        p.depth -= 1
        if p.depth == 0:
            p.waited_s += time.monotonic() - p.waiting_since
            p.waiting_since = None
            p.count += 1


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """Around a training step's work: only there is a rank that neither waits nor progresses stuck. Outside it
    (building, loading, saving, evaluating) one rank may work long while its peers wait, by design."""
    PROGRESS.stepping = True
    try:
        yield
    finally:
        PROGRESS.stepping = False


@dataclass
class Peer:
    """What this rank saw of one peer: its last heartbeat value, when (here) it last changed, and when its
    progress counter last moved."""

    value: str = ""
    changed: float = field(default_factory=time.monotonic)
    progressed: float = field(default_factory=time.monotonic)


def _beat_value() -> str:
    p = PROGRESS
    excused = p.waiting_since is not None or not p.stepping  # a peer waiting on it is not stuck on it
    return f"{time.time()!r} {p.count} {int(excused)} {socket.gethostname()}"


def lost_peer(peers: dict[int, Peer], values: dict[int, str], stopped: set[int], now: float,
              timeout: float, waited: float | None) -> str | None:
    """Update ``peers`` from the heartbeat ``values`` read at ``now``; the line declaring a lost peer, or None.
    ``waited``: how long this rank has been in its current wait (None: not waiting); ``stopped``: ranks whose
    stop trainmesh's launcher handles (its --stopped-grace), never declared here."""
    for rank, value in values.items():
        seen = peers.setdefault(rank, Peer(value, now, now))
        if value != seen.value:
            if value.split()[1:2] != seen.value.split()[1:2]:
                seen.progressed = now
            seen.value, seen.changed = value, now
    for rank, seen in sorted(peers.items()):
        if rank in stopped or seen.value == DONE:
            continue
        host = seen.value.split()[3] if len(seen.value.split()) > 3 else "?"
        if now - seen.changed > timeout:
            return (f"rank {rank} on {host} sent no heartbeat for {now - seen.changed:.1f} s (--peer-timeout "
                    f"{timeout:g}): its process is dead, stopped or frozen")
        peer_waits = seen.value.split()[2:3] == ["1"]
        if waited is not None and waited > timeout and not peer_waits and now - seen.progressed > timeout:
            return (f"rank {rank} on {host} is alive but has made no progress for {now - seen.progressed:.1f} s "
                    f"while this rank waited {waited:.1f} s for it (--peer-timeout {timeout:g}): it is stuck outside "
                    f"any collective (a busy loop, a deadlock)")
    return None


def _store_address() -> tuple[str, int]:
    """Where the run's store is: the launcher's, torchrun's, or rank 0's under srun."""
    world = world_env()
    if world.source == "slurm":
        return world.master_addr, world.master_port
    return os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))


@functools.cache
def start_heartbeat(peer_timeout: float = PEER_TIMEOUT_S) -> None:
    """In a rank of several: a daemon thread beats every HEARTBEAT_S and watches the other ranks' beats; a peer
    lost for ``peer_timeout`` s ends this rank with one line naming it (:data:`PEER_LOST_EXIT`), so the launcher
    or elastic agent restarts. One per process, joined at exit (a thread in the store's C++ client at teardown
    aborts)."""
    world = world_env()
    addr, port = _store_address()
    if world.world_size == 1 or not addr or not port:
        return
    timeout = datetime.timedelta(seconds=max(peer_timeout, 1.0))
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timeout)
    stop = threading.Event()
    thread = threading.Thread(target=_beat, args=(store, world.rank, world.world_size, peer_timeout, stop),
                              name="trainmesh-heartbeat", daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join(timeout=HEARTBEAT_S + 5)
        with contextlib.suppress(RuntimeError, OSError):
            store.set(heartbeat_key(world.rank), DONE)  # its peers may still be finishing: not lost

    atexit.register(end)


def _beat(store: dist.TCPStore, rank: int, world: int, peer_timeout: float, stop: threading.Event) -> None:
    """The heartbeat thread's loop: write this rank's beat, read the others', end the rank if one is lost."""
    others = [r for r in range(world) if r != rank]
    keys = [heartbeat_key(r) for r in others]
    peers: dict[int, Peer] = {}
    launched = os.environ.get(STORE_CLIENT_ENV) == "1"
    while not stop.is_set():
        try:
            store.set(heartbeat_key(rank), _beat_value())
            if len(peers) == len(others):  # every peer has beaten: one request for all
                values = dict(zip(others, (v.decode() for v in store.multi_get(keys))))
            else:
                values = {r: store.get(k).decode() for r, k in zip(others, keys) if store.check([k])}
            stopped = {r for r in others if launched and store.check([STOPPED_KEY.format(rank=r)])}
        except (RuntimeError, OSError) as e:
            if stop.is_set():
                return
            _end(f"the run's store at {':'.join(map(str, _store_address()))} stopped answering ({type(e).__name__}):"
                 f" its host (the launcher, or rank 0 under torchrun and srun) ended or its node is lost")
        now = time.monotonic()
        since = PROGRESS.waiting_since
        line = lost_peer(peers, values, stopped, now, peer_timeout, None if since is None else now - since)
        if line is not None:
            _end(line)
        stop.wait(HEARTBEAT_S)


def _end(line: str) -> None:
    """End this rank at once (its main thread may be blocked in a collective that would wait for its timeout)."""
    rank = os.environ.get("RANK", "?")
    os.write(2, f"trainmesh: rank {rank}: {line}; ending this rank so the run restarts or stops\n".encode())
    os._exit(PEER_LOST_EXIT)


def heartbeat_ages(store: dist.TCPStore, ranks: Sequence[int]) -> dict[int, float]:
    """Seconds since each rank's last heartbeat (ranks and launcher share one clock: one machine);
    ranks that have not written one yet are left out."""
    now = time.time()
    values = {r: store.get(heartbeat_key(r)).decode() for r in ranks if store.check([heartbeat_key(r)])}
    return {r: now - float(value.split()[0]) for r, value in values.items() if value != DONE}
