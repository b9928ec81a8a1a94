"""Spawn N local ranks, stream rank 0's output, and stop everything as soon as any rank fails.

The launcher hosts the rendezvous store itself on a socket it binds to 127.0.0.1 (port chosen by the
kernel, so no port race), and every rank joins as a client; Gloo is told to use the loopback interface,
so a local run listens on no external address. Ranks get the environment torchrun would give them
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), which is why the same entry point also runs unchanged
under torchrun across machines.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from trainmesh.mesh import STORE_CLIENT_ENV

POLL_S = 0.05
TERMINATE_GRACE_S = 3.0
REPORT_GRACE_S = 1.5  # after one rank fails, time for the others to fail too and say where they were
STACK_DUMP_S = 1.0  # time for ranks still running to print their stacks after SIGUSR1
TAIL_LINES = 200
COLLECTIVE_RE = re.compile(r"collective (\S+ #\d+) failed")
# What a rank says when a peer went away under it, in a collective trainmesh names (COLLECTIVE_RE) or in
# one it does not (logging reductions, object gathers, barriers): Gloo's and NCCL's own words.
PEER_LOST_RE = re.compile(r"Connection closed by peer|Connection reset by peer|remote process exited|"
                          r"NCCL communicator was aborted")


def _die_with_parent() -> None:
    """Linux: a rank gets SIGKILL if the launcher dies, so no rank outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None


def _pump_stderr(rp: RankProcess, echo: bool) -> None:
    for line in iter(rp.proc.stderr.readline, ""):
        rp.tail.append(line)
        if echo:
            sys.stderr.write(line)
            sys.stderr.flush()


def host_store() -> tuple[dist.TCPStore, int]:
    """A rendezvous store served by this process on 127.0.0.1 only."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach(), timeout=datetime.timedelta(seconds=300))
    return store, port


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            STORE_CLIENT_ENV: "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _stop(ranks: Sequence[RankProcess]) -> None:
    for rp in ranks:
        if rp.proc.poll() is None:
            rp.proc.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for rp in ranks:
        try:
            rp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rp.proc.kill()
            rp.proc.wait()


def _excerpt(rp: RankProcess) -> str:
    """The rank's last traceback, or its stack dump, or else the end of its stderr."""
    tail = "".join(rp.tail).rstrip()
    starts = [tail.rfind(marker) for marker in ("Traceback (most recent call last)", "Thread 0x", "Current thread")]
    start = min((i for i in starts if i >= 0), default=-1)
    return tail[start:] if start >= 0 else tail


def _collective(rp: RankProcess) -> str | None:
    found = COLLECTIVE_RE.findall("".join(rp.tail))
    return found[-1] if found else None


def _lost_a_peer(rp: RankProcess) -> bool:
    """Whether the rank failed because another one did: in a collective, or on a connection the peer closed."""
    return _collective(rp) is not None or PEER_LOST_RE.search("".join(rp.tail)) is not None


def _report_failure(ranks: Sequence[RankProcess], failed: RankProcess, rc: int) -> None:
    """Say which rank failed and how; if it was a collective, which ranks never arrived at it."""
    for rp in ranks:
        if rp.reader is not None:
            rp.reader.join(timeout=1.0)
    collective = _collective(failed)
    if collective:
        waiting = [rp.rank for rp in ranks if _collective(rp) == collective]
        missing = [rp.rank for rp in ranks if rp.rank not in waiting]
        sys.stderr.write(f"trainmesh: collective {collective} failed on rank(s) {waiting} ({_describe(rc)} on rank "
                         f"{failed.rank}); rank(s) {missing} never arrived at it; stopped all ranks\n")
        shown = [rp for rp in ranks if rp.rank in missing] + [failed]
    elif _lost_a_peer(failed):
        sys.stderr.write(f"trainmesh: rank {failed.rank} failed ({_describe(rc)}) after losing a peer, and no rank "
                         f"reported a failure of its own; stopped all ranks. Every rank's last words:\n")
        shown = [failed] + [rp for rp in ranks if rp is not failed]
    else:
        sys.stderr.write(f"trainmesh: rank {failed.rank} failed ({_describe(rc)}); stopped the other ranks\n")
        shown = [failed]
    for rp in shown:
        excerpt = _excerpt(rp)
        if excerpt:
            sys.stderr.write(f"--- rank {rp.rank} ---\n{excerpt}\n")
    sys.stderr.flush()


def _root_cause(failed: list[tuple[RankProcess, int]]) -> tuple[RankProcess, int]:
    """The failed rank to blame: one that failed on its own rather than because a peer had already died
    (whose error is only "connection closed by peer", in a collective or point-to-point operation trainmesh
    names or in one it does not); if all failed so (a hang, a timeout), the first of them."""
    for rp, rc in failed:
        if rp.reader is not None:
            rp.reader.join(timeout=1.0)
        if not _lost_a_peer(rp):
            return rp, rc
    return failed[0]


def _collect_stacks(ranks: Sequence[RankProcess]) -> None:
    """Give the other ranks a moment to fail too, then ask those still running for their stacks."""
    deadline = time.monotonic() + REPORT_GRACE_S
    while time.monotonic() < deadline and any(rp.proc.poll() is None for rp in ranks):
        time.sleep(POLL_S)
    alive = [rp for rp in ranks if rp.proc.poll() is None]
    for rp in alive:
        rp.proc.send_signal(signal.SIGUSR1)
    if alive:
        time.sleep(STACK_DUMP_S)


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run ``python -m trainmesh.cli *argv`` as ``nproc`` ranks; returns the exit code for the user."""
    store, port = host_store()
    ranks: list[RankProcess] = []
    for rank in range(nproc):
        proc = subprocess.Popen([sys.executable, "-m", "trainmesh.cli", *argv], env=rank_env(rank, nproc, port),
                                stdout=None if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, preexec_fn=_die_with_parent)
        rp = RankProcess(rank, proc)
        rp.reader = threading.Thread(target=_pump_stderr, args=(rp, rank == 0), daemon=True)
        rp.reader.start()
        ranks.append(rp)

    def on_signal(signum, _frame):
        _stop(ranks)
        sys.stderr.write(f"trainmesh: interrupted by {signal.Signals(signum).name}; stopped all ranks\n")
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(ranks)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        del store


def _supervise(ranks: list[RankProcess]) -> int:
    while True:
        running = False
        for rp in ranks:
            rc = rp.proc.poll()
            if rc is None:
                running = True
            elif rc != 0:
                _collect_stacks(ranks)
                failed = [(r, r.proc.returncode) for r in ranks if r.proc.poll() not in (None, 0)]
                _stop(ranks)
                root, root_rc = _root_cause(failed)
                _report_failure(ranks, root, root_rc)
                return root_rc if root_rc > 0 else 128 - root_rc
        if not running:
            for rp in ranks:
                rp.reader.join(timeout=1.0)
            return 0
        time.sleep(POLL_S)


def launch_with_restarts(argv: Sequence[str], nproc: int, max_restarts: int,
                         clear_on_restart: Sequence[str] = ()) -> int:
    """:func:`launch`, and after a failure launch every rank again with ``--resume`` (up to ``max_restarts``
    times), so the run continues from its latest complete checkpoint; returns the last attempt's exit code.

    Restarted ranks run without the environment variables in ``clear_on_restart`` (the fault injection
    ``TRAINMESH_FAULT``): an injected fault stands for a one-off failure, a lost node or an OOM kill, which
    the restarted run must not meet again at the same step.
    """
    rc = launch(argv, nproc)
    for attempt in range(1, max_restarts + 1):
        if rc == 0:
            break
        sys.stderr.write(f"trainmesh: restarting all {nproc} rank(s) from the latest complete checkpoint "
                         f"(restart {attempt} of {max_restarts})\n")
        for name in clear_on_restart:
            os.environ.pop(name, None)
        rc = launch([*argv, "--resume"], nproc)
    return rc

