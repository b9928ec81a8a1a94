"""Every port a run opens listens on the interface of the address the user named: a single-host run, static
or elastic, on loopback alone (#46). torch's stores are unauthenticated and its dynamic rendezvous unpickles
what it reads from its store, so a port on every interface is open to the whole network."""

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")


def _tree(root: int) -> set[int]:
    """``root`` and every process below it."""
    pids, todo = set(), [root]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass  # it ended
    return pids


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _listening() -> dict[str, tuple[str, int]]:
    """Inode -> (address, port) of every listening TCP socket of this host, IPv4 and IPv6."""
    found = {}
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                hexaddr, hexport = fields[1].split(":")
                raw = b"".join(bytes.fromhex(hexaddr[i:i + 8])[::-1] for i in range(0, 2 * size, 8))
                found[fields[9]] = (str(ipaddress.ip_address(raw)), int(hexport, 16))
    return found


def _listeners_of_run(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[tuple[str, int]]]:
    """Run ``python -m trainmesh *argv``, and every (address, port) its processes listened on meanwhile."""
    proc = subprocess.Popen([sys.executable, "-m", "trainmesh", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        listening = _listening()
        seen |= {listening[i] for pid in _tree(proc.pid) for i in _socket_inodes(pid) if i in listening}
        time.sleep(0.1)
    _, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err), seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_loopback_only(seen: set[tuple[str, int]]) -> None:
    assert seen, "saw no listening socket: the run ended before it could be looked at"
    assert all(ipaddress.ip_address(addr).is_loopback for addr, _ in seen), sorted(seen)


def test_a_static_two_rank_run_listens_on_loopback_alone(tmp_path):
    result, seen = _listeners_of_run(["train", "--nproc", "2", "--dp", "2", "--steps", "3", "--no-progress",
                                      "--out", str(tmp_path / "r")])
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_loopback_only(seen)


def test_a_single_host_elastic_run_listens_on_loopback_alone(tmp_path):
    """It listened on *:PORT (the agents' c10d store) and on *:N (rank 0's store of the round) before."""
    port = _free_port()
    result, seen = _listeners_of_run([
        "launch", "--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-conf", "join_timeout=60,last_call_timeout=1", "train", "--dp", "2", "--steps", "3", "--resume",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", "--out", str(tmp_path / "r")])
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_loopback_only(seen)
    assert ("127.0.0.1", port) in seen, "the rendezvous store was not hosted at the endpoint"
