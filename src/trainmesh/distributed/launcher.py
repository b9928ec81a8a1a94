"""Spawn N local ranks, stream rank 0's output, and stop everything as soon as any rank fails.

The launcher hosts the store on 127.0.0.1 (node 0 across nodes, torchrun's static rendezvous) and gives ranks
torchrun's environment; output goes to ``rank-N.log``. A stopped rank ends the job after ``--stopped-grace``; the
report blames an unresponsive rank, then one that failed on its own, then the ranks the others waited on."""

from __future__ import annotations

import ctypes
import datetime
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from trainmesh.distributed import shm
from trainmesh.distributed.heartbeat import HEARTBEAT_STALE_S, STOPPED_KEY, heartbeat_ages
from trainmesh.distributed.mesh import STORE_CLIENT_ENV, bound_store
from trainmesh.storage.safe_io import open_own_file

POLL_S = 0.05
TERMINATE_GRACE_S = 3.0
REPORT_GRACE_S = 1.5  # after one rank fails, time for the others to fail too and say where they were
STACK_DUMP_S = 1.0  # time for ranks still running to print their stacks after SIGUSR1
TAIL_LINES = 200
STOP_CHECK_S = 0.5  # how often the launcher reads its ranks' process states
STOPPED_GRACE_S = 60.0  # default of --stopped-grace: a debugger's pause is shorter, a forgotten Ctrl-Z longer
STOPPED_STATES = ("T", "t")  # /proc/PID/stat: stopped by a signal, stopped by a tracer
# the messages of trainmesh.distributed.comm.CollectiveError
COLLECTIVE_RE = re.compile(r"collective (?P<name>\S+?(?: #\d+)?)(?: \(ranks (?P<ranks>[\d,-]+)\))? failed")
P2P_RE = re.compile(r"p2p (?P<messages>\S+ \d+->\d+ #\d+(?: \+ \S+ \d+->\d+ #\d+)*) failed")
MESSAGE_RE = re.compile(r"(\w+)/(send|recv) (\d+)->(\d+) #(\d+)")
# What a rank says when a peer went away under it, in a collective trainmesh names or in one it does not
# (object gathers, barriers): Gloo's and NCCL's own words.
# Where a rank's output turns to a failure: a traceback, or a stack dump (SIGUSR1, faulthandler)
FAILURE_START_RE = re.compile(r"^(?:\[rank\d+\]: )?(?:Traceback \(most recent call last\)|Thread 0x|"
                              r"Current thread 0x|Fatal Python error)", re.M)
ERROR_NAME_RE = re.compile(r"^(?:\[rank\d+\]: )?(?:\w+\.)*(\w+(?:Error|Exception))\b", re.M)
PEER_LOST_RE = re.compile(r"Connection closed by peer|Connection reset by peer|remote process exited|"
                          r"NCCL communicator was aborted")


def _die_with_parent(parent: int | None = None) -> None:
    """Linux: a rank gets SIGKILL if the launcher dies, so no rank outlives it; one whose launcher ``parent``
    died before this ran (between fork and here, where no signal will come) ends at once."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)


@dataclass(frozen=True)
class Nodes:
    """Where this launcher sits among ``nnodes`` launchers (one per node) and where node 0 hosts the store."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def check(self) -> None:
        """One line for a setting that cannot work, before anything is started."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes}); number the "
                             f"nodes 0 to {self.nnodes - 1}")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValueError("--nnodes > 1 needs --master-port (or MASTER_PORT): the port node 0's launcher "
                             "listens on at --master-addr for the other nodes")


TERMINAL_ENV = "TRAINMESH_TERMINAL"
"""Set to 1 for a rank whose stdout the launcher streams, unprefixed, to a terminal: its pipe is not one, but
its progress bar may be drawn in place (:class:`trainmesh.tracking.records.Progress` reads it)."""
FAILED_KEY = "trainmesh/failed"  # "<rank> <node> <what>": the first rank that failed on its own, on any node


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    node: int | None = None  # set across nodes, to name it in reports
    quiet: bool = False  # echo no more: the rank printed a traceback or stack dump, or a rank failed
    held: list[str] = field(default_factory=list)  # what was not echoed, printed if the run succeeds after all
    log: RankLog | None = None
    pumps: list[threading.Thread] = field(default_factory=list)  # readers of stdout and stderr

    def join(self, timeout: float) -> None:
        for thread in self.pumps:
            thread.join(timeout=timeout)


class RankLog:
    """A rank's whole output, stdout and stderr as they come, in ``rank-N.log`` (appended, so a restart's output
    follows the failed attempt's under a header of its own); written from two reader threads, a chunk at a time."""

    def __init__(self, path: Path, header: str) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = open_own_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # never through a planted link
        self._lock = threading.Lock()
        self.write(f"==> {header} <==\n".encode())

    def write(self, data: bytes) -> None:
        """Append ``data``; a failed write (a full disk) stops this log with one line, never the rank, whose
        output must still be read from its pipe."""
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, data)
            except OSError as e:
                os.close(self._fd)
                self._fd = None
                say(f"trainmesh: warning: writing {self.path} failed ({e.strerror or e}); the rest of its output "
                    f"is not logged")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _where(rp: RankProcess) -> str:
    return f"rank {rp.rank}" + (f" on node {rp.node}" if rp.node is not None else "")


def _pump_stderr(rp: RankProcess, echo: bool, prefix: str) -> None:
    """Keep the rank's last lines for the report and log them; echo a streamed rank's until it turns to a
    failure (held back then, so the launcher's line naming the cause is printed first)."""
    for line in iter(rp.proc.stderr.readline, ""):
        rp.tail.append(line)
        if rp.log is not None:
            rp.log.write(line.encode(errors="replace"))
        rp.quiet = rp.quiet or FAILURE_START_RE.match(line) is not None
        if echo and rp.quiet:
            rp.held.append(prefix + line)
        elif echo:
            sys.stderr.write(prefix + line)
            sys.stderr.flush()


def _pump_stdout(rp: RankProcess, echo: bool, prefix: str) -> None:
    """Log the rank's stdout in whole lines (to a newline or carriage return, so stderr's lines never land inside one)
    and echo a streamed rank's: raw chunks unprefixed, whole lines under a prefix."""
    fd, pending, unlogged = rp.proc.stdout.fileno(), b"", b""
    while chunk := os.read(fd, 1 << 16):
        if rp.log is not None:
            unlogged += chunk
            end = max(unlogged.rfind(b"\n"), unlogged.rfind(b"\r")) + 1
            if end:
                rp.log.write(unlogged[:end])
                unlogged = unlogged[end:]
        if echo and prefix:
            *lines, pending = (pending + chunk).split(b"\n")
            _echo(b"".join(prefix.encode() + line + b"\n" for line in lines))
        elif echo:
            _echo(chunk)
    if rp.log is not None and unlogged:
        rp.log.write(unlogged)
    if echo and pending:
        _echo(prefix.encode() + pending + b"\n")


def _echo(data: bytes) -> None:
    """Write a rank's bytes to this process's stdout (its bytes, where it has them: a caller may have put a
    text-only stream there)."""
    out = sys.stdout
    if hasattr(out, "buffer"):
        out.flush()
        out.buffer.write(data)
        out.buffer.flush()
    else:
        out.write(data.decode(errors="replace"))
        out.flush()


def host_store(addr: str = "127.0.0.1", port: int = 0) -> tuple[dist.TCPStore, int]:
    """A rendezvous store served by this process on ``addr`` only (127.0.0.1 unless node 0 of several)."""
    store = bound_store(addr, port, datetime.timedelta(seconds=300))
    return store, store.port


OMP_SPIN = "10000"
"""Spins an idle OpenMP worker makes before sleeping (GNU's default, 300000, spins ~10 ms): a pipeline rank
that ran an action on a waiting neighbour's core (:func:`trainmesh.pipeline.runtime.lone_actions`) would
keep spinning on that core while the neighbour computes again, slowing it. Any count from 3,000 to 30,000
does as well; the default does worse (docs/performance.md)."""


def rank_env(rank: int, nproc: int, port: int, job: str, nodes: Nodes = Nodes()) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` on this node (``job`` names its shared-memory segments);
    Gloo uses loopback on one node, else ``GLOO_SOCKET_IFNAME`` or the host name's interface."""
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo" if nodes.nnodes == 1 else "")
    env = {**os.environ, "RANK": str(nodes.node_rank * nproc + rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(nodes.nnodes * nproc), "LOCAL_WORLD_SIZE": str(nproc),
           "MASTER_ADDR": nodes.master_addr if nodes.nnodes > 1 else "127.0.0.1", "MASTER_PORT": str(port),
           STORE_CLIENT_ENV: "1", "GLOO_SOCKET_IFNAME": ifname,
           shm.JOB_ENV: job,
           "OMP_NUM_THREADS": threads, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", OMP_SPIN),
           "PYTHONUNBUFFERED": "1"}
    if not ifname:
        del env["GLOO_SOCKET_IFNAME"]
    return env


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


@dataclass(frozen=True)
class Wait:
    """What a failed rank was waiting for, parsed from its :class:`~trainmesh.distributed.comm.CollectiveError`."""

    rank: int
    what: str  # "collective dp/all_reduce #33", or "pp message 1->0 #4 (its recv from rank 1)"
    needs: frozenset[int]  # the ranks it needed: its collective's group, or the other end of its message(s)


def _parse_ranks(text: str) -> frozenset[int]:
    """The inverse of :func:`trainmesh.distributed.comm.format_ranks`."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return frozenset(ranks)


def _wait_of(rp: RankProcess, world: int) -> Wait | None:
    """The last collective or message the rank reports as failed, with the ranks it was waiting on."""
    text = "".join(rp.tail)
    found = max((*COLLECTIVE_RE.finditer(text), *P2P_RE.finditer(text)), key=lambda m: m.start(), default=None)
    if found is None:
        return None
    if found.re is COLLECTIVE_RE:
        group = _parse_ranks(found["ranks"]) if found["ranks"] else frozenset(range(world))
        return Wait(rp.rank, f"collective {found['name']}", group)
    messages = MESSAGE_RE.findall(found["messages"])
    needs = frozenset(int(src) if kind == "recv" else int(dst) for _, kind, src, dst, _ in messages)
    return Wait(rp.rank, " + ".join(_describe_message(*m) for m in messages), needs)


def _describe_message(axis: str, kind: str, src: str, dst: str, n: str) -> str:
    """``pp message 1->0 #13 (its recv from rank 1)``: the message, and which end of it the rank was."""
    end = f"its recv from rank {src}" if kind == "recv" else f"its send to rank {dst}"
    return f"{axis} message {src}->{dst} #{n} ({end})"


def _never_arrived(waits: dict[int, Wait]) -> dict[int, list[int]]:
    """For each waiting rank, the ranks it needed that were not waiting for anything themselves: those are
    where the hang is (a rank it needed that was itself waiting is a victim further down the chain)."""
    return {rank: sorted(w.needs - waits.keys() - {rank}) for rank, w in waits.items()}


def _stuck_reason(rp: RankProcess, age: float | None) -> str | None:
    """Why a still-running rank counts as unresponsive, or None: its process is stopped (SIGSTOP, a
    debugger), or its heartbeat thread has not written for HEARTBEAT_STALE_S (the whole process is frozen)."""
    reasons = []
    if _process_state(rp.proc.pid) in STOPPED_STATES:
        reasons.append("its process is stopped")
    if age is not None and age > HEARTBEAT_STALE_S:
        reasons.append(f"no heartbeat for {age:.1f} s")
    return "; ".join(reasons) or None


def _process_state(pid: int) -> str | None:
    """Linux: the one-letter state in /proc/PID/stat (R, S, D, T, ...); None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _unresponsive(ranks: Sequence[RankProcess], store: dist.TCPStore) -> dict[int, str]:
    """Ranks still running that are stopped or frozen, with the reason; measured before the ranks are stopped."""
    try:
        ages = heartbeat_ages(store, [rp.rank for rp in ranks])
    except (RuntimeError, OSError):
        ages = {}  # the store's host (node 0's launcher) has gone
    found = {}
    for rp in ranks:
        if rp.proc.poll() is None and (reason := _stuck_reason(rp, ages.get(rp.rank))):
            found[rp.rank] = reason
    return found


def _report_failure(ranks: Sequence[RankProcess], failed: list[tuple[RankProcess, int]],
                    unresponsive: dict[int, str]) -> tuple[RankProcess, int]:
    """Say which rank is to blame and return it (its exit code is the launcher's): one that stopped responding, else
    one that failed on its own, else those the failed ones waited on."""
    for rp in ranks:
        rp.join(timeout=1.0)
    waits = {rp.rank: w for rp, _ in failed if (w := _wait_of(rp, len(ranks)))}
    first, first_rc = failed[0]
    if unresponsive:
        stuck = sorted(unresponsive)
        waited = f" waiting for {waits[first.rank].what}" if first.rank in waits else ""
        reasons = "; ".join(f"rank {r}: {why}" for r, why in unresponsive.items())
        _write(f"trainmesh: rank(s) {stuck} stopped responding ({reasons}); rank {first.rank} failed{waited} "
               f"({_describe(first_rc)}); stopped all ranks", [*stuck, first.rank], ranks)
        return first, first_rc
    on_its_own = [(rp, rc) for rp, rc in failed if rp.rank not in waits and not _lost_a_peer(rp)]
    if on_its_own:
        rp, rc = on_its_own[0]
        _write(f"trainmesh: {_where(rp)} failed ({_describe(rc)}); stopped the other ranks", [rp.rank], ranks)
        return rp, rc
    lines, shown = _never_arrived_lines(waits, {rp.rank: rc for rp, rc in failed})
    if not lines and first.rank not in waits:
        lines = [f"trainmesh: rank {first.rank} failed ({_describe(first_rc)}) after losing a peer, and no rank "
                 f"reported a failure of its own. Every rank's last words:"]
        shown = [first.rank] + [rp.rank for rp in ranks if rp is not first]
    elif not lines:
        lines, shown = [f"trainmesh: rank {first.rank} failed waiting for {waits[first.rank].what} "
                        f"({_describe(first_rc)}), as did rank(s) {sorted(waits)}"], [first.rank]
    _write("\n".join(lines) + "; stopped all ranks", shown, ranks)
    return first, first_rc


def _lost_a_peer(rp: RankProcess) -> bool:
    """Whether the rank failed only because a peer went away (Gloo's or NCCL's words for it), in a call
    that trainmesh does not name (a named one is a :class:`Wait`)."""
    return PEER_LOST_RE.search("".join(rp.tail)) is not None


def _never_arrived_lines(waits: dict[int, Wait], rcs: dict[int, int]) -> tuple[list[str], list[int]]:
    """One line per collective or message that some rank never arrived at, naming the ranks that waited
    and those that never came; and the ranks whose stacks to show (the absent ones first)."""
    missing = _never_arrived(waits)
    lines, shown = [], []
    for what in dict.fromkeys(w.what for w in waits.values() if missing[w.rank]):
        waiting = sorted(r for r, w in waits.items() if w.what == what)
        absent = sorted({r for w in waiting for r in missing[w]})
        how = _describe(rcs[waiting[0]])
        if what.startswith("collective "):
            lines.append(f"trainmesh: {what} failed on rank(s) {waiting} ({how} on rank {waiting[0]}); "
                         f"rank(s) {absent} never arrived at it")
        else:
            lines.append(f"trainmesh: rank {waiting[0]} waited on rank(s) {absent} for {what} and failed ({how}); "
                         f"rank(s) {absent} never arrived at it")
        shown += [r for r in [*absent, waiting[0]] if r not in shown]
    return lines, shown


def _write(headline: str, shown: Sequence[int], ranks: Sequence[RankProcess]) -> None:
    """The report: the headline, the last traceback or stack of each rank named in it, then one line for each
    other rank that printed a failure, naming the file that holds its output."""
    sys.stderr.write(headline + "\n")
    for rp in ranks:
        excerpt = _excerpt(rp) if rp.rank in shown else ""
        if excerpt:
            sys.stderr.write(f"--- rank {rp.rank} ---\n{excerpt}\n")
    others = [rp for rp in ranks if rp.rank not in shown and FAILURE_START_RE.search("".join(rp.tail))]
    logs = _log_paths(ranks) if others else None
    for rp in others:
        sys.stderr.write(f"trainmesh: rank {rp.rank} {_aftermath(rp, len(ranks))}; its output: {logs[rp.rank]}\n")
    sys.stderr.flush()


def _aftermath(rp: RankProcess, world: int) -> str:
    """What a rank not to blame went through, in a few words: the call it failed in, or that it was stopped."""
    wait = _wait_of(rp, world)
    errors = ERROR_NAME_RE.findall("".join(rp.tail))
    what = (f"failed waiting for {wait.what}" if wait else "lost its connection to a peer" if _lost_a_peer(rp)
            else "failed" if errors else "was stopped (its stack was dumped)")
    return what + (f" ({errors[-1]})" if errors else "")


def _log_paths(ranks: Sequence[RankProcess]) -> dict[int, Path]:
    """Where each rank's output is: its ``rank-N.log`` in the run's log directory, else its last TAIL_LINES
    lines of stderr in ``rank-N.log`` of a new temporary directory."""
    if all(rp.log is not None for rp in ranks):
        return {rp.rank: rp.log.path for rp in ranks}
    folder = Path(tempfile.mkdtemp(prefix="trainmesh-ranks-"))
    logs = {rp.rank: folder / f"rank-{rp.rank}.log" for rp in ranks}
    for rp in ranks:
        logs[rp.rank].write_text("".join(rp.tail))
    return logs


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


@dataclass
class StopWatch:
    """The ranks seen stopped and since when: a warning when a stop is first seen, a note when the rank
    continues, and the rank whose stop has outlasted ``grace`` seconds."""

    grace: float
    store: dist.TCPStore | None = None  # where the stops are posted, for the ranks' watchdogs to leave to the grace
    since: dict[int, float] = field(default_factory=dict)
    checked: float = 0.0

    def overdue(self, ranks: Sequence[RankProcess]) -> RankProcess | None:
        """Look at the ranks (at most every STOP_CHECK_S); the first stopped for longer than the grace."""
        now = time.monotonic()
        if now - self.checked < STOP_CHECK_S:
            return None
        self.checked = now
        for rp in ranks:
            stopped = rp.proc.poll() is None and _process_state(rp.proc.pid) in STOPPED_STATES
            if stopped and rp.rank not in self.since:
                self.since[rp.rank] = now
                self._post(rp.rank, True)
                say(f"trainmesh: warning: rank {rp.rank} (pid {rp.proc.pid}) is stopped (SIGSTOP or a debugger) "
                    f"and its peers wait for it; the job ends in {self.grace:g} s unless it continues "
                    f"(kill -CONT {rp.proc.pid}; --stopped-grace sets the wait)")
            elif not stopped and rp.rank in self.since:
                self._post(rp.rank, False)
                say(f"trainmesh: rank {rp.rank} (pid {rp.proc.pid}) continued after "
                    f"{now - self.since.pop(rp.rank):.1f} s stopped")
        return next((rp for rp in ranks if now - self.since.get(rp.rank, now) > self.grace), None)

    def _post(self, rank: int, stopped: bool) -> None:
        """Tell the ranks' watchdogs (:mod:`trainmesh.distributed.heartbeat`) that ``rank`` is stopped, or no
        longer: a stop is this launcher's to judge, after the grace, not theirs after --peer-timeout."""
        if self.store is None:
            return
        key = STOPPED_KEY.format(rank=rank)
        try:
            self.store.set(key, "1") if stopped else self.store.delete_key(key)
        except (RuntimeError, OSError):
            pass  # node 0's launcher, which hosts the store, has gone


def say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _join_store(nodes: Nodes) -> tuple[dist.TCPStore, int]:
    """The run's store: hosted here on one node or on node 0 (at the master address only), joined elsewhere."""
    if nodes.nnodes == 1:
        return host_store()
    if nodes.node_rank == 0:
        return host_store(nodes.master_addr, nodes.master_port)
    store = dist.TCPStore(nodes.master_addr, nodes.master_port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    return store, nodes.master_port


def parse_tee(text: str, world: int) -> frozenset[int]:
    """``--tee``: ``all`` or comma-separated global ranks below ``world``; a ValueError says what to give."""
    if text.strip() == "all":
        return frozenset(range(world))
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--tee {text!r}: give rank numbers separated by commas (0,1) or all") from None
    if not ranks or not all(0 <= r < world for r in ranks):
        raise ValueError(f"--tee {text}: the ranks are 0 to {world - 1}; give some of them (0,1) or all")
    return ranks


def _start_rank(local: int, nproc: int, command: list[str], environment: dict[str, str], nodes: Nodes,
                log_dir: Path | None, tee: frozenset[int]) -> RankProcess:
    """Start one rank with readers that log its output and stream it if ``tee`` holds it."""
    rank = int(environment["RANK"])
    if rank in tee and tee == {0} and sys.stdout.isatty():  # its output reaches a terminal, through a pipe
        environment = {**environment, TERMINAL_ENV: "1", "COLUMNS": str(shutil.get_terminal_size().columns)}
    proc = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=functools.partial(_die_with_parent, os.getpid()))
    rp = RankProcess(rank, proc, node=nodes.node_rank if nodes.nnodes > 1 else None)
    if log_dir is not None:
        started = datetime.datetime.now().isoformat(timespec="seconds")
        rp.log = RankLog(log_dir / f"rank-{rank}.log", f"rank {rank} of {environment['WORLD_SIZE']} (local rank "
                         f"{local}) on {socket.gethostname()}, pid {proc.pid}, started {started}")
    prefix = "" if tee == {0} else f"[rank {rank}] "
    rp.pumps = [threading.Thread(target=pump, args=(rp, rank in tee, prefix), daemon=True)
                for pump in (_pump_stderr, _pump_stdout)]
    for thread in rp.pumps:
        thread.start()
    return rp


def launch(argv: Sequence[str], nproc: int, program: Sequence[str] = ("-m", "trainmesh"),
           stopped_grace: float = STOPPED_GRACE_S, nodes: Nodes = Nodes(),
           env: Mapping[str, str] | None = None, log_dir: Path | None = None,
           tee: frozenset[int] = frozenset({0})) -> int:
    """Run ``python *program *argv`` as ``nproc`` ranks on this node with ``env`` added and return the user's exit code;
    output to ``log_dir/rank-N.log`` and, for ``tee``, to stdout/stderr; a rank stopped past ``stopped_grace`` ends it.
    """
    nodes.check()
    store, port = _join_store(nodes)
    job = shm.new_job()
    ranks = [_start_rank(local, nproc, [sys.executable, *program, *argv],
                         {**rank_env(local, nproc, port, job, nodes), **(env or {})}, nodes, log_dir, tee)
             for local in range(nproc)]

    def on_signal(signum, _frame):
        _stop(ranks)
        sys.stderr.write(f"trainmesh: interrupted by {signal.Signals(signum).name}; stopped all ranks\n")
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(ranks, store, StopWatch(stopped_grace, store), nodes)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        del store
        shm.remove_segments(job)  # every rank has ended: _supervise returns only then
        for rp in ranks:
            rp.join(timeout=1.0)
            if rp.log is not None:
                rp.log.close()


def _post_failure(store: dist.TCPStore, rp: RankProcess, rc: int) -> None:
    """Tell the other nodes which rank failed on its own (killed, or an error not caused by a lost peer):
    the first such report wins (``compare_set`` from empty)."""
    if rc < 0 or not _lost_a_peer(rp):
        try:
            store.compare_set(FAILED_KEY, "", f"{rp.rank} {rp.node} {_describe(rc)}")
        except (RuntimeError, OSError):
            pass  # node 0's launcher, which hosts the store, is gone: it has stopped its ranks already


def _failure_elsewhere(store: dist.TCPStore, nodes: Nodes) -> str | None:
    """The failure another node posted (``rank R on node K failed (...)``), or None."""
    if nodes.nnodes == 1:
        return None
    try:
        if not store.check([FAILED_KEY]):
            return None
        rank, node, what = store.get(FAILED_KEY).decode().split(" ", 2)
    except (RuntimeError, OSError):
        return None  # node 0's launcher has ended (its ranks too): this node's ranks end, or fail, on their own
    if int(node) == nodes.node_rank:
        return None
    return f"rank {rank} on node {node} failed ({what})"


def _supervise(ranks: list[RankProcess], store: dist.TCPStore, watch: StopWatch, nodes: Nodes) -> int:
    while True:
        running = False
        for rp in ranks:
            rc = rp.proc.poll()
            if rc is None:
                running = True
            elif rc != 0:
                for other in ranks:
                    other.quiet = True  # the cause's line comes first: nothing more is echoed
                if nodes.nnodes > 1:
                    _post_failure(store, rp, rc)
                _collect_stacks(ranks)
                failed = [(r, r.proc.returncode) for r in ranks if r.proc.poll() not in (None, 0)]
                failed.sort(key=lambda f: f[0] is not rp)
                unresponsive = _unresponsive(ranks, store)
                _stop(ranks)
                elsewhere = _failure_elsewhere(store, nodes)
                if elsewhere is not None:
                    return _stopped_for(elsewhere, nodes)
                _, root_rc = _report_failure(ranks, failed, unresponsive)
                return root_rc if root_rc > 0 else 128 - root_rc
        if running and (elsewhere := _failure_elsewhere(store, nodes)) is not None:
            _stop(ranks)
            return _stopped_for(elsewhere, nodes)
        if not running:
            for rp in ranks:
                rp.join(timeout=1.0)
                sys.stderr.writelines(rp.held)  # a traceback a rank printed and survived
            return 0
        late = watch.overdue(ranks)
        if late is not None:
            late.proc.kill()  # a stopped process acts on no SIGTERM until continued
            _stop(ranks)
            say(f"trainmesh: rank {late.rank} (pid {late.proc.pid}) stayed stopped for more than {watch.grace:g} s "
                f"(--stopped-grace); stopped all ranks")
            return 1
        time.sleep(POLL_S)


def _stopped_for(elsewhere: str, nodes: Nodes) -> int:
    sys.stderr.write(f"trainmesh: {elsewhere}; node {nodes.node_rank} stopped its ranks\n")
    sys.stderr.flush()
    return 1


def launch_with_restarts(argv: Sequence[str], nproc: int, max_restarts: int,
                         env_of: Callable[[bool], Mapping[str, str]], clear_on_restart: Sequence[str] = (),
                         stopped_grace: float = STOPPED_GRACE_S, log_dir: Path | None = None,
                         tee: frozenset[int] = frozenset({0})) -> int:
    """:func:`launch`, relaunching every rank after a failure (up to ``max_restarts``) with ``env_of(True)`` to
    resume from the latest checkpoint, without ``clear_on_restart`` variables (an injected fault is one-off)."""
    rc = launch(argv, nproc, stopped_grace=stopped_grace, env=env_of(False), log_dir=log_dir, tee=tee)
    for attempt in range(1, max_restarts + 1):
        if rc == 0:
            break
        sys.stderr.write(f"trainmesh: restarting all {nproc} rank(s) from the latest complete checkpoint "
                         f"(restart {attempt} of {max_restarts})\n")
        for name in clear_on_restart:
            os.environ.pop(name, None)
        rc = launch(argv, nproc, stopped_grace=stopped_grace, env=env_of(True), log_dir=log_dir, tee=tee)
    return rc

