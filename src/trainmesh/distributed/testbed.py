"""A multi-node test bed on one Linux host: each "node" a network namespace, the link between them real.

Each node has a rate-limited veth ``eth0`` (``10.77.0.<k+1>/24``, ``tc tbf``) on a hub bridge and its own host name,
so shared memory stays inside a node and cross-node bytes are counted (:meth:`TestBed.link_bytes`).
:func:`missing_capability` names what the host lacks (root, ``ip``, ``tc``, ``unshare``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
ETC_NETNS = Path("/etc/netns")
TOOLS = ("ip", "tc", "unshare")


def missing_capability() -> str | None:
    """Why no bed can be built here (one line), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root to build the multi-node test bed"
    missing = [tool for tool in TOOLS if _tool(tool) is None]
    if missing:
        return f"the multi-node test bed needs {', '.join(missing)} (iproute2, util-linux), not found"
    return None


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)


def _run(*argv: str) -> str:
    done = subprocess.run([_tool(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Node:
    """One node of the bed: its namespace, address and host name."""

    index: int
    netns: str
    addr: str
    hostname: str
    ifname: str = "eth0"


@dataclass
class TestBed:
    """``nodes`` network namespaces joined through a bridge by veths limited to ``rate_mbit`` each way (None:
    unlimited). Use as a context manager; names carry this process's id, so two beds never collide."""

    nodes: int
    rate_mbit: float | None = None
    tag: str = field(default_factory=lambda: f"tm{os.getpid() % 100000}")
    members: list[Node] = field(default_factory=list, init=False)
    _made: list[str] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)

    __test__ = False  # not a pytest test class

    @property
    def hub(self) -> str:
        return f"{self.tag}hub"

    def __enter__(self) -> "TestBed":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _name_service(self) -> None:
        """Give every namespace a hosts file naming the nodes and a resolver with no server (via ``/etc/netns``), so
        c10d's name lookups are answered at once instead of waiting for an unreachable DNS server."""
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.hostname}\n" for n in self.members)
        for ns in self._made:
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def _build(self) -> None:
        self._netns(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for k in range(self.nodes):
            node = Node(k, f"{self.tag}n{k}", f"{SUBNET}.{k + 1}", f"node{k}")
            self._netns(node.netns)
            port = f"p{k}"
            _run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", node.ifname,
                 "netns", node.netns)
            _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _run("ip", "-n", node.netns, "link", "set", node.ifname, "up")
            if self.rate_mbit:
                for ns, dev in ((node.netns, node.ifname), (self.hub, port)):
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                         f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "200ms")
            self.members.append(node)
        self._name_service()

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``node``: inside its network namespace, under its own host name."""
        n = self.members[node]
        return [_tool("ip"), "netns", "exec", n.netns, _tool("unshare"), "--uts", "--", "sh", "-c",
                f'hostname {n.hostname} && exec "$@"', "sh", *argv]

    def start(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **popen: object) -> subprocess.Popen:
        """Start ``argv`` on ``node`` with Gloo bound to the node's interface; :meth:`close` ends it if it runs on."""
        env = {**(env or os.environ), "GLOO_SOCKET_IFNAME": self.members[node].ifname}
        proc = subprocess.Popen(self.command(node, argv), env=env, **popen)
        self._procs.append(proc)
        return proc

    def link_bytes(self) -> int:
        """Bytes sent so far by every node over its veth (each byte crossing between nodes is counted once,
        by its sender), from the kernel's interface counters."""
        total = 0
        for n in self.members:
            stats = json.loads(_run("ip", "-n", n.netns, "-s", "-j", "link", "show", n.ifname))[0]
            total += stats["stats64"]["tx"]["bytes"]
        return total

    def kill_node(self, node: int) -> None:
        """SIGKILL every process on ``node``, as when a machine is lost."""
        for pid in self.pids([self.members[node].netns]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def pids(self, namespaces: Sequence[str] | None = None) -> list[int]:
        """Processes still running in the bed's namespaces (or in ``namespaces``)."""
        found = []
        for ns in self._made if namespaces is None else namespaces:
            try:
                found += [int(p) for p in _run("ip", "netns", "pids", ns).split()]
            except RuntimeError:
                pass
        return found

    def close(self) -> None:
        """Kill what still runs in the bed (the processes it started, then any left in its namespaces: all
        descendants of those) and delete its namespaces, which takes their veths and bridge with them."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(50):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for ns in reversed(self._made):
            subprocess.run([_tool("ip") or "ip", "netns", "delete", ns], capture_output=True, timeout=30)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        self._made.clear()
        self.members.clear()
