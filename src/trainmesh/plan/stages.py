"""Pipeline stage splits: which blocks each stage holds. The runtime balances parameters unless ``--stage-layers`` is
given; the planner proposes :func:`fastest_split` of the modelled times (Llama 3 405B's 126 layers on 16 stages come
out as the paper's 7, 8 x 14, 7 [Llama 3, 3.3.2])."""

from __future__ import annotations

import functools

from trainmesh.models.spec import ModelShape
from trainmesh.pipeline.partition import balanced_partition
from trainmesh.plan.flops import is_moe_layer


@functools.lru_cache(maxsize=4096)
def fastest_split(costs: tuple[float, ...], head: float, chunks: int) -> tuple[int, ...]:
    """Blocks per chunk minimising the slowest chunk (given block costs in model order and the head's), by bisection
    over :func:`_fill_to`, filled from the last chunk so the first (embedding, most micro-batches in flight) gets the
    rest."""
    low, high = max(costs), sum(costs) + head
    for _ in range(100):
        if high - low <= 1e-12 * high:
            break
        middle = (low + high) / 2
        low, high = (low, middle) if _fill_to(costs, head, chunks, middle) else (middle, high)
    split = _fill_to(costs, head, chunks, high)
    assert split is not None
    return split


def _fill_to(costs: tuple[float, ...], head: float, chunks: int, bound: float) -> tuple[int, ...] | None:
    """Chunks filled from the last backwards, each as full as ``bound`` allows while leaving a block per earlier chunk;
    None if the first then exceeds ``bound`` (greedy packing takes the fewest chunks, so nothing meets it)."""
    counts, stop = [], len(costs)
    for k in range(chunks - 1, 0, -1):
        load, start = head if k == chunks - 1 else 0.0, stop
        while start - 1 >= k and load + costs[start - 1] <= bound:
            start -= 1
            load += costs[start]
        if start == stop:
            return None
        counts.append(stop - start)
        stop = start
    return (stop, *reversed(counts)) if sum(costs[:stop]) <= bound else None


@functools.lru_cache(maxsize=1024)
def parameter_split(m: ModelShape, chunks: int) -> tuple[int, ...]:
    """The runtime's split without ``--stage-layers``: parameter counts balanced, the embedding counted on
    the first chunk and the final norm and head (a tied one a copy) on the last (``partition.partition_model``)."""
    base = m.block_norm_params + m.attention_params()
    sizes = [base + (m.moe_params() if is_moe_layer(m, i) else m.mlp_params(m.d_ff, True)) for i in range(m.n_layers)]
    embed = m.vocab_size * m.d_model + (m.seq_len * m.d_model if m.learned_positions else 0)
    return tuple(len(r) for r in balanced_partition(sizes, chunks, embed, m.d_model * m.vocab_size))


def rank_layers(split: tuple[int, ...], pp: int, stage: int) -> list[range]:
    """The blocks rank ``stage`` holds: chunks ``stage``, ``stage + pp``, ... of ``split``."""
    starts = [sum(split[:c]) for c in range(len(split))]
    return [range(starts[c], starts[c] + split[c]) for c in range(stage, len(split), pp)]


def rank_blocks(m: ModelShape, split: tuple[int, ...], pp: int, stage: int) -> tuple[int, int]:
    """(dense, MoE) blocks on one rank of ``stage`` under ``split``."""
    return _rank_blocks(split, pp, stage, m.n_dense_layers if m.n_experts else m.n_layers)


@functools.lru_cache(maxsize=2**16)  # a search asks for the same few stages of thousands of layouts
def _rank_blocks(split: tuple[int, ...], pp: int, stage: int, dense_layers: int) -> tuple[int, int]:
    layers = [i for r in rank_layers(split, pp, stage) for i in r]
    dense = sum(i < dense_layers for i in layers)
    return dense, len(layers) - dense


def stage_kinds(m: ModelShape, split: tuple[int, ...], pp: int) -> tuple[tuple[int, int], ...]:
    """(first stage of its kind, how many) for each kind of stage (dense and MoE blocks, first or last): a stage's
    estimates depend on nothing else, and later stages of a kind hold no more micro-batches than the first."""
    return _stage_kinds(split, pp, m.n_dense_layers if m.n_experts else m.n_layers)


@functools.lru_cache(maxsize=2**14)
def _stage_kinds(split: tuple[int, ...], pp: int, dense_layers: int) -> tuple[tuple[int, int], ...]:
    kinds: dict[tuple[tuple[int, int], bool, bool], list[int]] = {}
    for s in range(pp):
        kinds.setdefault((_rank_blocks(split, pp, s, dense_layers), s == 0, s == pp - 1), []).append(s)
    return tuple((stages[0], len(stages)) for stages in kinds.values())
