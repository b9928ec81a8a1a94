"""The layout search: every layout the cluster can run, each estimated (:func:`estimate`), the ones that fit
ranked by predicted step time (:func:`search`, :func:`best_layout`)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterator

from trainmesh.layout import RECOMPUTE, ZERO_STAGES, Layout, LayoutError, validate
from trainmesh.models.spec import ModelShape, divisors
from trainmesh.distributed.hardware import GIB, Cluster
from trainmesh.plan.memory import MemoryBreakdown, candidate_stages, memory_per_rank
from trainmesh.plan.stages import fastest_split
from trainmesh.plan.timing import TimeBreakdown, dp_time, layer_seconds, peak_flops, step_flops, step_time
from trainmesh.plan.workload import Workload, check_layout

LONG_SEQUENCE = 16384  # from here on the search also tries context parallelism
MIN_CP_CHUNK = 1024  # tokens per head-tail chunk below which cp is not tried


@dataclass(frozen=True)
class Estimate:
    """A layout with its worst-stage memory and predicted step; ``mfu`` counts model FLOPs [PALM, app. B],
    ``tflops_per_device`` executed ones [NAR, 5.1]."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    mfu: float
    tflops_per_device: float
    tokens_per_s: float


def estimate(workload: Workload, layout: Layout, cluster: Cluster, memory: MemoryBreakdown | None = None) -> Estimate:
    """Memory and time of one layout (``memory`` may be passed in when already computed)."""
    time = step_time(workload, layout, cluster)
    t = time.total
    mfu = step_flops(workload) / (t * layout.world * peak_flops(workload, cluster))
    tflops = step_flops(workload, layout.recompute) / (t * layout.world) / 1e12
    tokens = workload.global_batch * workload.seq_len / t
    return Estimate(layout, memory or memory_per_rank(workload, layout), time, mfu, tflops, tokens)


# Larger micro-batches make larger matmuls (:func:`gemm_efficiency`) but a longer bubble and more activations.
MICRO_BATCH_SIZES = (1, 2, 4, 8)


def _schedules(pp: int, n_layers: int, microbatches: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    yield from (("gpipe", 1), ("1f1b", 1), ("zb", 1))
    if microbatches % pp == 0:
        yield from (("interleaved", v) for v in interleave_depths(pp, n_layers))


def interleave_depths(pp: int, n_layers: int) -> list[int]:
    """The chunks per rank the search tries: 2, 4, 8 and the deepest up to 8 the runtime runs (pp * v <= n_layers),
    since the bubble shrinks as 1/v (Llama 3 405B's 126 layers on 16 stages: v = 7, beside the paper's 8 [Llama 3,
    3.3.2])."""
    deepest = min(8, n_layers // pp)
    return sorted({v for v in (2, 4, 8) if v <= deepest} | ({deepest} if deepest > 1 else set()))


def cp_degrees(workload: Workload, cluster: Cluster) -> list[int]:
    """The cp sizes worth searching: 1, and from :data:`LONG_SEQUENCE` tokens every power of two leaving chunks of at
    least :data:`MIN_CP_CHUNK` tokens (shorter ones leave the ring's messages nothing to hide behind)."""
    if workload.seq_len < LONG_SEQUENCE:
        return [1]
    degrees, cp = [1], 2
    while cp <= cluster.gpus and workload.seq_len % (2 * cp) == 0 and workload.seq_len // (2 * cp) >= MIN_CP_CHUNK:
        degrees.append(cp)
        cp *= 2
    return degrees


def _meshes(workload: Workload, cluster: Cluster) -> Iterator[tuple[int, int, int, int]]:
    """(dp, cp, tp, pp) over exactly ``cluster.gpus`` ranks with each tp group inside one node."""
    m = workload.model
    for cp in cp_degrees(workload, cluster):
        for tp in divisors(cluster.gpus_per_node):
            if cluster.gpus % (tp * cp):
                continue
            for pp in divisors(cluster.gpus // (tp * cp)):
                dp = cluster.gpus // (tp * cp * pp)
                if pp <= m.n_layers and workload.global_batch % dp == 0 and _splits(m, tp, pp):
                    yield dp, cp, tp, pp


def _splits(model: ModelShape, tp: int, pp: int) -> bool:
    """Whether tp x pp can split ``model`` by the layout's rules (whole heads per tp rank)."""
    try:
        validate(Layout(tp=tp, pp=pp), model)
    except LayoutError:
        return False
    return True


def ep_degrees(model: ModelShape, token_ranks: int) -> list[int]:
    """The ep sizes an MoE model can take over ``token_ranks`` (:attr:`trainmesh.layout.Layout.token_ranks`): those
    dividing both them and the expert count; [1] for a dense model."""
    return [e for e in divisors(token_ranks) if model.n_experts % e == 0] if model.n_experts else [1]


def enumerate_layouts(workload: Workload, cluster: Cluster) -> Iterator[Layout]:
    """Every valid layout on the cluster: micro-batch sizes, v, cp, ep, the pipeline's fastest stage split and hybrid
    sharding, skipping what the layout's rules refuse; a hybrid layout comes right after its fully sharded twin."""
    for dp, cp, tp, pp in _meshes(workload, cluster):
        per_replica = workload.global_batch // dp
        sps = (False, True) if tp > 1 and (workload.seq_len // cp) % tp == 0 else (False,)
        for micro in (per_replica // b for b in MICRO_BATCH_SIZES if per_replica % b == 0):
            costs = layer_seconds(workload, Layout(dp=dp, tp=tp, cp=cp, microbatches=micro), cluster)
            options = (list(_schedules(pp, workload.model.n_layers, micro)), ZERO_STAGES, RECOMPUTE, sps)
            replicas = (1, *hsdp_replicas(dp, cp, tp, cluster))
            for (schedule, v), zero, recompute, sp, r in itertools.product(*options, replicas):
                split = fastest_split(*costs, pp * v) if pp > 1 else ()
                for ep in ep_degrees(workload.model, dp * cp * (tp if sp else 1)):
                    candidate = _candidate(workload, dp=dp, tp=tp, pp=pp, zero=zero, microbatches=micro,
                                           schedule=schedule, virtual_stages=v, recompute=recompute,
                                           sequence_parallel=sp, cp=cp, ep=ep, stage_layers=split, dp_replicate=r)
                    if candidate is not None:
                        yield candidate


def hsdp_replicas(dp: int, cp: int, tp: int, cluster: Cluster) -> list[int]:
    """The ``dp_replicate`` worth searching beside 1: every R >= 2 whose ZeRO groups fill whole nodes, one-node groups
    first (FSDP2's and torchtitan's default; larger as [MiCS]'s partition groups); None when a group fits in a node."""
    span = tp * cp * dp
    if span % cluster.gpus_per_node or tp >= cluster.gpus_per_node:
        return []
    nodes = span // cluster.gpus_per_node
    return [r for r in sorted(divisors(nodes), reverse=True) if r > 1 and dp % r == 0]


def _candidate(workload: Workload, **settings: object) -> Layout | None:
    """``Layout(**settings)`` if it keeps the layout's rules for ``workload``, else None."""
    try:
        layout = Layout(**settings)
        check_layout(workload, layout)
    except LayoutError:
        return None
    return layout


# Predicted step times this close to the fastest (relative) count as equal: the model is no more exact.
TIE_TOLERANCE = 0.01


MAX_GPUS = 1 << 20
"""The most devices the search takes: over 2**20 a tiny model's search takes ~1 s and DeepSeek-V3's ~2 min
(one shared CPU core); larger counts are typos (a billion ran for hours, enumerating its divisors)."""
MAX_LAYERS = 1 << 12
"""The most layers the search splits over pipeline stages: 32x Llama 3 405B's 126 (an HF config may give
2**31 - 1, whose stage splits alone would not end)."""
SEARCH_LIMIT_S = 300.0
"""How long :func:`search` may run (checked between layouts) before it stops in one line instead of running
on unseen."""


def search(workload: Workload, cluster: Cluster, limit_s: float = SEARCH_LIMIT_S) -> list[Estimate]:
    """All layouts fitting ``cluster.usable_bytes`` per rank, fastest first (then least memory), hybrid variants only
    at their smallest fitting groups. ValueError beyond :data:`MAX_GPUS` devices or past ``limit_s``."""
    if not 1 <= cluster.gpus <= MAX_GPUS:
        raise ValueError(f"{cluster.gpus:,} devices: the planner searches 1 to {MAX_GPUS:,}; plan fewer")
    if workload.model.n_layers > MAX_LAYERS:
        raise ValueError(f"{workload.model.n_layers:,} layers: the planner searches models of up to {MAX_LAYERS:,}; "
                         f"plan fewer (--layers)")
    found: list[Estimate] = []
    flat: Estimate | None = None  # the last layout sharded over all its dp ranks, if it fits
    hybrid_fits = False  # whether a hybrid-sharded variant of ``flat`` fits: larger groups are then not tried
    stop = time.monotonic() + limit_s
    for tried, layout in enumerate(enumerate_layouts(workload, cluster)):
        if time.monotonic() > stop:
            raise ValueError(f"the layout search over {cluster.gpus:,} devices passed its {limit_s:g} s limit after "
                             f"{tried:,} layouts; plan fewer devices or layers, or a smaller global batch")
        if layout.dp_replicate > 1 and (hybrid_fits or not _hybrid_may_win(workload, layout, cluster, flat)):
            continue
        memory = memory_per_rank(workload, layout)
        fits = memory.total <= cluster.usable_bytes
        if fits:
            found.append(estimate(workload, layout, cluster, memory))
        if layout.dp_replicate == 1:
            flat, hybrid_fits = (found[-1] if fits else None), False
        else:
            hybrid_fits = fits
    found.sort(key=lambda e: (e.time.total, e.memory.total, e.layout.microbatches))
    return found


def _hybrid_may_win(workload: Workload, layout: Layout, cluster: Cluster, flat: Estimate | None) -> bool:
    """Whether hybrid-sharded ``layout`` is worth estimating beside ``flat``, the same layout over all its dp ranks
    (None: it does not fit): not when ``flat`` does not fit or moves its dp bytes at least as fast."""
    return flat is not None and _dp_seconds(workload, layout, cluster) < _dp_seconds(workload, flat.layout, cluster)


def _dp_seconds(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """The data-parallel traffic of the rank that has the most, hidden or not: exposed, a hybrid layout's is
    no smaller than the flat one's when this is not (its extra part, the replica all-reduce, is never hidden)."""
    return max(dp_time(workload, layout, cluster, s) for s in candidate_stages(workload, layout))


def choose(found: list[Estimate]) -> Estimate | None:
    """The layout to run among ``found`` (fastest first): among those within :data:`TIE_TOLERANCE` of the fastest, the
    one with most headroom, since a layout that barely fits fails first. None when nothing fits."""
    if not found:
        return None
    tied = [e for e in found if e.time.total <= found[0].time.total * (1 + TIE_TOLERANCE)]
    return min(tied, key=lambda e: (e.memory.total, e.time.total))


def runner_up(found: list[Estimate], chosen: Estimate) -> Estimate | None:
    """The fastest layout of ``found`` other than ``chosen``: the one the choice is explained against."""
    return next((e for e in found if e is not chosen), None)


def best_layout(workload: Workload, cluster: Cluster) -> Layout:
    """The layout :func:`choose` takes of :func:`search`'s; what ``trainmesh train --plan auto`` runs."""
    chosen = choose(search(workload, cluster))
    if chosen is None:
        raise ValueError(
            f"no layout of {workload.model.n_params():,} parameters fits in {cluster.usable_bytes / GIB:.1f} "
            f"usable GiB on {cluster.gpus} devices; add devices, lower global_batch or seq_len, or use a "
            f"smaller model"
        )
    return chosen.layout
