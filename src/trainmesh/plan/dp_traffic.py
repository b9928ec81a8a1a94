"""Data-parallel traffic of one step (ZeRO-0/1/2/3 and hybrid sharding), split into bytes inside a node and bytes
across nodes, each at its link's bandwidth: a ring runs at the inter-node link's pace [THA], point-to-point exchanges
(:func:`trainmesh.parallel.zero.flat.exchanges_directly`) use both links at once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainmesh.distributed.hardware import Cluster
from trainmesh.plan.memory import UnitSize, stage_expert_units, stage_units
from trainmesh.layout import Layout
from trainmesh.plan.workload import Workload, stage_split


def ring_gather_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """Ring all-gather or reduce-scatter of ``nbytes`` in total: (n-1)(alpha + S/(n B)) [THA]."""
    bw, alpha = link
    return (n - 1) * (alpha + nbytes / (n * bw)) if n > 1 else 0.0


def all_reduce_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """The faster of ring, 2(n-1)(alpha + S/(nB)), and binomial tree, 2 ceil(log2 n)(alpha + S/B) [THA]."""
    if n == 1:
        return 0.0
    bw, alpha = link
    tree = 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bw)
    return min(2 * ring_gather_time(nbytes, n, link), tree)


@dataclass(frozen=True)
class DpTraffic:
    """Bytes one rank sends per step over dp inside its node (``intra``) and across nodes (``inter``), the seconds that
    takes, and how many are ``prefetched`` (ZeRO-3's per-unit collectives, which may run beside compute)."""

    intra: float = 0.0
    inter: float = 0.0
    seconds: float = 0.0
    prefetched: float = 0.0

    def __add__(self, other: DpTraffic) -> DpTraffic:
        return DpTraffic(self.intra + other.intra, self.inter + other.inter, self.seconds + other.seconds,
                         self.prefetched + other.prefetched)

    def __mul__(self, times: int) -> DpTraffic:
        return DpTraffic(self.intra * times, self.inter * times, self.seconds * times, self.prefetched * times)

    def ahead(self) -> DpTraffic:
        """The same traffic, all of it issued ahead of the compute that needs it."""
        return dataclasses.replace(self, prefetched=self.seconds)


def ranks_per_node(ranks: int, stride: int, gpus_per_node: int) -> int:
    """Ranks of a group of ``ranks`` ranks ``stride`` apart (from a node's first rank) that share a node."""
    return min(ranks, max(1, gpus_per_node // stride))


def crossing_share(n: int, per_node: int, direct: bool) -> float:
    """The average share of what a rank of an n-rank exchange sends that crosses nodes (``per_node`` ranks a node): a
    ring's 1 hop in ``per_node``, or point to point its n - g peers on other nodes."""
    if per_node >= n:
        return 0.0
    return (n - per_node) / (n - 1) if direct else 1 / per_node


def collective(kind: str, nbytes: float, n: int, per_node: int, cluster: Cluster, calls: int = 1) -> DpTraffic:
    """One ``all_gather``, ``reduce_scatter`` or ``all_reduce`` of ``nbytes`` over n ranks as ``calls`` collectives: a
    rank sends (n-1)/n of the bytes, twice to all-reduce [THA], at the ring's slowest link or point to point at each's
    own."""
    if n == 1:
        return DpTraffic()
    sent = nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)
    direct = cluster.direct_exchange and kind != "all_reduce"
    inter = sent * crossing_share(n, per_node, direct)
    intra_link, inter_link = cluster.link(1), cluster.link(cluster.gpus_per_node + 1)
    link = intra_link if per_node >= n else inter_link
    if direct and per_node < n:
        seconds = (n - 1) * link[1] + max((sent - inter) / intra_link[0], inter / inter_link[0])
    elif kind == "all_reduce":
        seconds = all_reduce_time(nbytes, n, link)
    else:
        seconds = ring_gather_time(nbytes, n, link)
    return DpTraffic(sent - inter, inter, seconds + (calls - 1) * (n - 1) * link[1])


def zero_traffic(units: tuple[tuple[UnitSize, int], ...], n: int, stride: int, replicas: int, workload: Workload,
                 layout: Layout, cluster: Cluster) -> DpTraffic:
    """One step's traffic of ``units`` ZeRO-sharded over n ranks ``stride`` apart in ``replicas`` groups [ZeRO, sec. 7]:
    2 Psi for ZeRO-0/1, a reduce-scatter per micro-batch for ZeRO-2, 3 Psi per micro-batch (4 under zero bubble,
    prefetched) for ZeRO-3; hybrid sharding adds an all-reduce of each gradient shard over the replicas."""
    m, b, g = layout.microbatches, workload.dtype_bytes, ranks_per_node(n, stride, cluster.gpus_per_node)
    if n * replicas == 1 or not units:
        return DpTraffic()
    psi = sum((-(-u.numel // n) * n if layout.zero else u.numel) * k for u, k in units)
    if layout.zero == 0:
        return collective("all_reduce", b.grad * psi, n, g, cluster)
    calls = sum(k for _, k in units) if layout.zero == 3 else 1
    gather = collective("all_gather", b.param * psi, n, g, cluster, calls)
    scatter = collective("reduce_scatter", b.grad * psi, n, g, cluster, calls)
    passes = 3 if layout.schedule == "zb" else 2
    within = {1: scatter + gather, 2: scatter * m + gather, 3: ((gather * passes + scatter) * m).ahead()}[layout.zero]
    across = ranks_per_node(replicas, stride * n, cluster.gpus_per_node)
    return within + collective("all_reduce", b.grad * psi / n, replicas, across, cluster)


def dp_traffic(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> DpTraffic:
    """Data-parallel traffic of one step on a rank of ``stage``: dense units over the shard group (dp x cp, tp apart),
    routed experts over their edp group (``Layout.ep_span`` apart); :func:`~trainmesh.plan.timing.exposed_dp_time`
    hides it."""
    lay, model = layout, workload.model
    split = stage_split(workload, lay)
    dense = stage_units(model, lay.tp, split, lay.pp, stage)
    experts = stage_expert_units(model, split, lay.pp, lay.ep, stage, lay.etp)
    return (zero_traffic(dense, lay.shard_ranks, lay.tp, lay.dp_replicate, workload, lay, cluster)
            + zero_traffic(experts, lay.expert_shard_ranks, lay.ep_span, lay.dp_replicate, workload, lay, cluster))
