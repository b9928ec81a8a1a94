"""One layout of a training run and the rules it must keep, each written once for every front door.

The CLI (:mod:`trainmesh.app.config`), the Python API and the planner each build a :class:`Layout` and
call :func:`validate`, which raises :class:`LayoutError` with one line naming the setting and the fix,
spelled for the audience by a :data:`Spell` (:func:`flag` or :func:`keyword`). This module sits low: it
reads a model only as a :class:`~trainmesh.models.spec.ModelShape`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from trainmesh.models.spec import ModelShape, divisors

ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")  # trainmesh.pipeline.schedules builds each
RECOMPUTE = ("none", "selective", "full")  # trainmesh.parallel.recompute applies each
PRECISIONS = ("fp32", "bf16", "fp16", "fp64", "fp8")
PRECISION_CHOICES = ("auto", *PRECISIONS)  # what --precision takes: auto resolves by resolve_precision
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp64")
CP_IMPLS = ("ring", "a2a")
AXES = ("dp", "cp", "tp", "pp")  # the mesh axes whose product is the world (ep folds inside them)
MESH_SIZES = ("dp", "tp", "pp", "cp", "ep", "etp", "dp_replicate")  # what a Mesh holds; parallelize applies the rest
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb


class LayoutError(ValueError):
    """A layout that cannot run; the message is one line naming the setting and what to change."""


@dataclass(frozen=True)
class Bound:
    """One end of a setting's allowed range; ``strict`` excludes the bound itself."""

    value: float
    strict: bool = False


def option(default: Any, help: str, choices: Collection | None = None, low: Bound | None = None,
           high: Bound | None = None) -> Any:
    """A setting's field with its help text (``--help``) and what it accepts: ``choices``, or ``low``/``high``."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "low": low, "high": high})


def _number(value: float) -> str:
    """A bound as a person reads it: whole numbers with thousands separators (1,048,576), others short."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def range_text(low: Bound | None, high: Bound | None) -> str:
    """The range ``low``..``high`` as a message says it: ``in [1, 1,048,576]``, ``at least 0``."""
    if low and high:
        opening, closing = "(" if low.strict else "[", ")" if high.strict else "]"
        return f"in {opening}{_number(low.value)}, {_number(high.value)}{closing}"
    if low:
        return f"{'greater than' if low.strict else 'at least'} {_number(low.value)}"
    return f"{'less than' if high.strict else 'at most'} {_number(high.value)}"


def outside(value: float, low: Bound | None, high: Bound | None) -> bool:
    """Whether ``value`` lies beyond ``low`` or ``high`` (NaN does not: check finiteness first)."""
    below = low is not None and (value <= low.value if low.strict else value < low.value)
    above = high is not None and (value >= high.value if high.strict else value > high.value)
    return below or above


AT_LEAST_0, AT_LEAST_1, ABOVE_0 = Bound(0), Bound(1), Bound(0, strict=True)
MAX_RANKS = Bound(1 << 20)  # ranks and parallel degrees: far beyond any cluster, far below int overflow
MAX_SEQUENCES = Bound(1 << 20)  # sequences per step (global batch, micro-batches): 1M, 16x Llama 3's


@dataclass(frozen=True)
class Layout:
    """Every setting a layout rule reads, under the names the command line, API, manifest and planner share: mesh
    sizes (``ep`` folds inside :attr:`token_ranks`), ``dp_replicate``, ZeRO stage, schedule, memory savers and dtypes,
    ``bucket_mb``, ``compile``/``cuda_graphs`` and ``timeline`` (a pipeline picture; empty: none)."""

    dp: int = option(1, "data-parallel degree", low=AT_LEAST_1, high=MAX_RANKS)
    tp: int = option(1, "tensor-parallel degree", low=AT_LEAST_1, high=MAX_RANKS)
    pp: int = option(1, "pipeline-parallel degree", low=AT_LEAST_1, high=MAX_RANKS)
    cp: int = option(1, "context-parallel degree: each sequence split over cp ranks (2*cp head-tail chunks)",
                     low=AT_LEAST_1, high=MAX_RANKS)
    ep: int = option(1, "expert-parallel degree (MoE models): each MoE layer's experts split over ep data-parallel "
                     "ranks, tokens exchanged by all-to-all; ep divides dp*cp (dp*cp*tp under --sequence-parallel, "
                     "folding over tp) and the expert count, adds no ranks", low=AT_LEAST_1, high=MAX_RANKS)
    etp: int = option(1, "expert tensor-parallel degree (MoE models): each routed expert's FFN split over etp of the "
                      "ranks holding the same experts (w1/w3 by column, w2 by row), tokens gathered over them; "
                      "ep*etp divides the ranks ep does, independent of --tp", low=AT_LEAST_1, high=MAX_RANKS)
    dp_replicate: int = option(1, "hybrid sharding (HSDP): split dp into this many replica groups of consecutive "
                               "ranks (inside a node by default); --zero shards within a group and all-reduces the "
                               "gradient shards across groups", low=AT_LEAST_1, high=MAX_RANKS)
    zero: int = option(0, "ZeRO stage on the data-parallel axis (dp x cp under --cp)", ZERO_STAGES)
    sequence_parallel: bool = option(False, "sequence parallelism over tp: LayerNorm regions split along the "
                                     "sequence, all-gather/reduce-scatter in place of all-reduce (needs --tp > 1)")
    schedule: str = option("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved (1F1B over --virtual-stages "
                           "chunks per rank) or zb (zero-bubble ZB-H1)", SCHEDULES)
    virtual_stages: int = option(1, "model chunks per pipeline rank: at least 2 with --schedule interleaved, "
                                 "1 with any other", low=AT_LEAST_1, high=Bound(1024))
    microbatches: int = option(1, "micro-batches per step on each data-parallel rank (gradient accumulation); "
                               "at most the sequences each rank gets per step", low=AT_LEAST_1, high=MAX_SEQUENCES)
    stage_layers: tuple[int, ...] = option((), "layers of each pipeline stage in model order, comma-separated "
                                           "(one per stage, pp * virtual-stages of them), e.g. 1,3; default: "
                                           "balanced by parameter count")
    recompute: str = option("none", "activation recomputation: full (each block) or selective (attention core)",
                            RECOMPUTE)
    precision: str = option("fp32", "parameter and compute dtype; bf16/fp16 keep fp32 master weights and "
                            "optimizer state (fp16 with dynamic loss scaling); fp8 is bf16 with the block linears "
                            "multiplying in float8 (torchao; FP8 GPUs or CPU; with --tp too); fp64 for exact "
                            "equivalence checks (default: auto, bf16 on a GPU that has it, else fp32)",
                            PRECISION_CHOICES)
    reduce_dtype: str = option("auto", "dtype gradients are accumulated and reduced in (auto: fp32, or fp64 under "
                               "--precision fp64)", REDUCE_DTYPES)
    cp_impl: str = option("ring", "context-parallel attention: ring (K/V blocks passed around the cp ranks) or "
                          "a2a (all-to-all to whole sequences for 1/cp of the heads, DeepSpeed-Ulysses)", CP_IMPLS)
    bucket_mb: float = option(DEFAULT_BUCKET_MB, "gradient bucket size in MB for the data-parallel AllReduce",
                              low=ABOVE_0, high=Bound(1 << 20))
    compile: bool = option(False, "torch.compile each transformer block")
    cuda_graphs: bool = option(False, "with --compile on CUDA: capture the compiled blocks as CUDA graphs "
                               "(mode reduce-overhead); MoE models, pipelines, ZeRO-3, --tp and CPU runs compile "
                               "without them and say why once")
    timeline: str = option("", "draw the last step's measured pipeline timeline (ranks x time) to this PNG")

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # as given, or read back from JSON

    def record(self) -> dict[str, int | str]:
        """The layout as every record of a run names it: a checkpoint's manifest, a run log's first record and
        summary (which ``trainmesh report`` labels runs by), written here only so that they all agree."""
        names = ("dp", "dp_replicate", "cp", "tp", "pp", "ep", "etp", "zero", "microbatches", "schedule", "precision")
        return {"world_size": self.world, **{name: getattr(self, name) for name in names}}

    def forms(self) -> dict[str, object]:
        """The settings :func:`trainmesh.api.parallelize` applies on a mesh: every field but the mesh's sizes and
        ``timeline`` (which only the command line draws)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in (*MESH_SIZES, "timeline")}

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes, as the gradient engines cut their buckets."""
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def grad_dtype(self) -> str:
        """``reduce_dtype`` resolved (:func:`resolve_reduce_dtype`)."""
        return resolve_reduce_dtype(self.precision, self.reduce_dtype)

    @property
    def world(self) -> int:
        """Ranks the layout runs on."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def grad_ranks(self) -> int:
        """Ranks gradients are reduced over and ZeRO shards over: dp x cp (Megatron's dp-cp group)."""
        return self.dp * self.cp

    @property
    def token_ranks(self) -> int:
        """Ranks that hold different tokens, which ep splits the routed experts over: dp x cp, and under
        sequence parallelism each tp rank's slice of the sequence too (ep folds over tp, as Megatron-core's
        MoE parallel folding does with one expert tensor-parallel rank)."""
        return self.grad_ranks * (self.tp if self.sequence_parallel else 1)

    @property
    def experts_over_tp(self) -> bool:
        """Whether the ep groups fold over tp: sequence parallelism with tp and ep above 1, so that each tp
        rank holds other experts, where otherwise the tp ranks of an ep rank hold the same ones."""
        return self.sequence_parallel and self.tp > 1 and self.ep * self.etp > 1

    @property
    def expert_data_ranks(self) -> int:
        """Ranks holding the same routed experts, over which their gradients are reduced and ZeRO shards them:
        the token ranks an ep x etp group leaves (dp x cp without experts split)."""
        return self.token_ranks // (self.ep * self.etp) if self.ep * self.etp > 1 else self.grad_ranks

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards over: the ``dp_cp`` ranks of one hybrid-sharding replica group (all of them
        without ``dp_replicate``)."""
        return self.grad_ranks // self.dp_replicate

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks ZeRO shards the routed experts over: :attr:`expert_data_ranks`, or without ep the
        :attr:`shard_ranks` every parameter is sharded over."""
        return self.expert_data_ranks if self.ep * self.etp > 1 else self.shard_ranks

    @property
    def ep_span(self) -> int:
        """Consecutive ranks an ep group (etp innermost) reaches across: ep x etp where it folds over tp, else
        its ranks lie tp apart."""
        return self.ep * self.etp * (1 if self.experts_over_tp else self.tp)


def resolve_precision(precision: str, bf16_device: bool) -> str:
    """The precision a run trains in: ``precision``, or for ``auto`` bf16 with fp32 masters where the device computes
    in bf16, else fp32; ``train`` (local device) and ``plan`` (target cluster) both resolve it here."""
    if precision != "auto":
        return precision
    return "bf16" if bf16_device else "fp32"


def resolve_reduce_dtype(precision: str, reduce_dtype: str) -> str:
    """The dtype gradients are reduced in: ``reduce_dtype``, or for ``auto`` never less than fp32 (fp64 under
    fp64). The runtime and the planner both resolve it here, so a plan holds for the run it describes."""
    if reduce_dtype != "auto":
        return reduce_dtype
    return "fp64" if precision == "fp64" else "fp32"


# --- spelling: one rule, two audiences --------------------------------------------------------------------

_ALONE = object()

Spell = Callable[..., str]
"""``spell(field)`` names a setting, ``spell(field, value)`` writes it with a value, as one audience types it."""


def flag(field: str, value: object = _ALONE) -> str:
    """The command line's spelling: ``--virtual-stages``, ``--pp 2``, ``--sequence-parallel``,
    ``--stage-layers 1,3``."""
    name = "--" + field.replace("_", "-")
    if value is _ALONE:
        return name
    if isinstance(value, bool):
        return name if value else "--no-" + name[2:]
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return f"{name} {value}"


def keyword(field: str, value: object = _ALONE) -> str:
    """The Python API's spelling: ``virtual_stages``, ``pp=2``, ``schedule='zb'``. The world is started outside
    the API, so ``nproc`` is spelled as the commands that start it."""
    if field == "nproc":
        return f"trainmesh launch --nproc {value} or torchrun --nproc-per-node {value}"
    return field if value is _ALONE else f"{field}={value!r}"


def _either(choices: Sequence[object]) -> str:
    names = [str(c) for c in choices]
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def _braced(values: Sequence[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


# --- the rules: each reads a _Check and returns the problem, or None ---------------------------------------


@dataclass(frozen=True)
class _Check:
    """What the rules read: the layout, the model's shape and the world when known, and how to spell."""

    layout: Layout
    model: ModelShape | None
    world_size: int | None
    spell: Spell
    name: str


Rule = Callable[[_Check], str | None]


def _values(c: _Check) -> str | None:
    """Each setting among its field's choices and within its bounds, as the command line checks its flags."""
    for f in dataclasses.fields(Layout):
        value, meta = getattr(c.layout, f.name), f.metadata
        allowed = PRECISIONS if f.name == "precision" else meta["choices"]  # a layout's precision is resolved
        if allowed is not None and value not in allowed:
            return f"{c.spell(f.name, value)}: choose {_either(allowed)}"
        if meta["low"] and (value != value or outside(value, meta["low"], meta["high"])):  # NaN is outside too
            return f"{c.spell(f.name, value)}: must be {range_text(meta['low'], meta['high'])}"
    return None


def _world(c: _Check) -> str | None:
    lay, world = c.layout, c.world_size
    if world is None or lay.world == world:
        return None
    product = "*".join(str(getattr(lay, a)) for a in AXES)
    return (f"world size {world} != dp*cp*tp*pp = {product} = {lay.world}; launch {lay.world} rank(s) "
            f"({c.spell('nproc', lay.world)}) or change {'/'.join(c.spell(a) for a in AXES)} so their product "
            f"is {world}")


def _expert_ranks(c: _Check) -> str | None:
    lay = c.layout
    if lay.token_ranks % (lay.ep * lay.etp) == 0:
        return None
    if lay.etp > 1:
        return (f"{c.spell('ep', lay.ep)} x {c.spell('etp', lay.etp)} does not divide the {lay.token_ranks} ranks "
                f"holding different tokens, which the expert groups split; choose ep*etp in "
                f"{_braced(divisors(lay.token_ranks))}")
    over = "dp*cp*tp" if lay.sequence_parallel else "dp*cp"
    hint = (f", or set {c.spell('sequence_parallel', True)} so that ep folds over tp too"
            if lay.tp > 1 and not lay.sequence_parallel and (lay.grad_ranks * lay.tp) % lay.ep == 0 else "")
    return (f"{c.spell('ep', lay.ep)} does not divide {over} = {lay.token_ranks}: experts are split over the ranks "
            f"that hold different tokens; choose ep in {_braced(divisors(lay.token_ranks))} or raise "
            f"{c.spell('dp')}{hint}")


def _hybrid_shards(c: _Check) -> str | None:
    """Hybrid sharding (FSDP2's 2-D mesh, DeepSpeed's MiCS) splits dp into ``dp_replicate`` groups each holding a set
    of ZeRO shards: it needs ZeRO and a dp it divides, and does not (yet) split expert-data-parallel groups."""
    lay, s = c.layout, c.spell
    if lay.dp_replicate == 1:
        return None
    if lay.dp % lay.dp_replicate:
        return (f"{s('dp_replicate', lay.dp_replicate)} does not divide {s('dp', lay.dp)}: the dp ranks split into "
                f"dp_replicate groups of equal size; choose dp_replicate in {_braced(divisors(lay.dp))}")
    if lay.ep * lay.etp > 1:
        split = [name for name in ("ep", "etp") if getattr(lay, name) > 1]
        return (f"{s('dp_replicate', lay.dp_replicate)} with {' '.join(s(n, getattr(lay, n)) for n in split)}: hybrid "
                f"sharding does not split the expert-data-parallel groups; use {' and '.join(s(n, 1) for n in split)} "
                f"or drop {s('dp_replicate')}")
    return None


def _hybrid_needs_zero(c: _Check) -> str | None:
    lay, s = c.layout, c.spell
    if lay.dp_replicate > 1 and lay.zero == 0:
        return (f"{s('dp_replicate', lay.dp_replicate)} replicates ZeRO's shards across groups, and "
                f"{s('zero', 0)} shards nothing; set {s('zero')} to 1, 2 or 3, or drop {s('dp_replicate')}")
    return None


def _sequence_parallel(c: _Check) -> str | None:
    if c.layout.sequence_parallel and c.layout.tp == 1:
        return (f"{c.spell('sequence_parallel', True)} splits the sequence over tensor-parallel ranks; set "
                f"{c.spell('tp')} > 1 or drop {c.spell('sequence_parallel')}")
    return None


PIPELINE_ONLY = {"virtual_stages": 1, "stage_layers": (), "timeline": ""}  # setting -> its value without a pipeline


def _pipeline_only(c: _Check) -> str | None:
    given = [f for f, unset in PIPELINE_ONLY.items() if getattr(c.layout, f) != unset]
    if c.layout.pp > 1 or not given:
        return None
    pp = c.spell("pp")
    return f"{c.spell(given[0])} is a pipeline setting and {pp} is 1; set {pp} > 1 or drop {c.spell(given[0])}"


def _virtual_stages(c: _Check) -> str | None:
    """Interleaving and virtual stages go together (Narayanan et al. 2021). Megatron-LM likewise asks for the
    number of chunks rather than guessing one, which would change the memory a run needs."""
    lay, s = c.layout, c.spell
    interleaved = lay.schedule == "interleaved"
    if lay.pp == 1 or interleaved == (lay.virtual_stages > 1):
        return None
    if interleaved:
        return (f"{s('schedule', 'interleaved')} runs several model chunks per pipeline rank; set "
                f"{s('virtual_stages')} >= 2 (e.g. {s('virtual_stages', 2)}) or use another schedule")
    return (f"{s('virtual_stages', lay.virtual_stages)} needs {s('schedule', 'interleaved')} ({lay.schedule} holds "
            f"one stage per rank); use {s('schedule', 'interleaved')} or {s('virtual_stages', 1)}")


def _interleaved_groups(c: _Check) -> str | None:
    lay = c.layout
    if lay.schedule != "interleaved" or lay.microbatches % lay.pp == 0:
        return None
    return (f"{c.spell('schedule', 'interleaved')} sends micro-batches through the chunks in groups of "
            f"pp={lay.pp}; set {c.spell('microbatches')} to a multiple of {lay.pp} (got {lay.microbatches})")


def _zero_bubble(c: _Check) -> str | None:
    """The zero-bubble schedule (Qi et al. 2023) splits backward at module outputs, which the ring's backward
    does not provide and torch.compile fuses away."""
    lay, s = c.layout, c.spell
    if lay.pp == 1 or lay.schedule != "zb":
        return None
    if lay.cp > 1:
        return (f"{s('cp', lay.cp)} with {s('schedule', 'zb')}: the zero-bubble schedule splits backward at module "
                f"outputs, which the ring's backward does not provide; use {s('schedule', '1f1b')}")
    if lay.compile:
        return (f"{s('schedule', 'zb')} splits backward at module outputs, which torch.compile fuses away; drop "
                f"{s('compile')} or use {s('schedule', '1f1b')}")
    return None


def _cuda_graphs(c: _Check) -> str | None:
    if c.layout.cuda_graphs and not c.layout.compile:
        return (f"{c.spell('cuda_graphs', True)} captures the compiled blocks as CUDA graphs; add "
                f"{c.spell('compile', True)} or drop {c.spell('cuda_graphs')}")
    return None


def _compiled_ring(c: _Check) -> str | None:
    if c.layout.cp > 1 and c.layout.compile:
        return (f"{c.spell('cp', c.layout.cp)} with {c.spell('compile', True)} would trace the ring's "
                f"point-to-point messages; drop {c.spell('compile')}")
    return None


def _stage_layers(c: _Check) -> str | None:
    lay, counts = c.layout, c.layout.stage_layers
    stages = lay.pp * lay.virtual_stages
    total = None if c.model is None else c.model.n_layers
    if not counts or (len(counts) == stages and min(counts) >= 1 and total in (None, sum(counts))):
        return None
    layers = "the model's layers" if total is None else f"the {total} layers of {c.name}"
    return (f"{c.spell('stage_layers', counts)} must give {stages} counts (pp * virtual_stages), each >= 1, "
            f"summing to {layers}")


MESH_SHAPE_RULES: tuple[Rule, ...] = (_values, _world, _expert_ranks, _hybrid_shards, _sequence_parallel)
"""The rules on the mesh's sizes alone: what ``init_mesh`` checks before the ZeRO stage, the schedule and the
rest are chosen (by ``parallelize``, which checks every rule)."""

MESH_RULES: tuple[Rule, ...] = (*MESH_SHAPE_RULES, _hybrid_needs_zero, _pipeline_only, _virtual_stages,
                                _interleaved_groups, _zero_bubble, _cuda_graphs, _compiled_ring,
                                _stage_layers)
"""The rules on the settings alone, in the order their messages are given."""


# --- rules on the model's shape -----------------------------------------------------------------------------


def _stage_count(c: _Check) -> str | None:
    lay, n = c.layout, c.model.n_layers
    if lay.pp * lay.virtual_stages <= n:
        return None
    if lay.virtual_stages == 1:
        return f"{c.spell('pp', lay.pp)} exceeds the {n} layers of {c.name}; choose pp <= {n}"
    return (f"{c.spell('pp', lay.pp)} x {c.spell('virtual_stages', lay.virtual_stages)} = "
            f"{lay.pp * lay.virtual_stages} stages exceed the {n} layers of {c.name}, and every stage needs "
            f"one; choose pp * virtual_stages <= {n}")


def _tensor_split(c: _Check) -> str | None:
    """tp must divide every size it splits, each tp rank holding whole heads (Megatron-LM likewise refuses a
    tp that does not divide the key/value heads)."""
    tp, sizes = c.layout.tp, c.model.tp_sizes()
    for what, size in sizes.items():
        if size % tp:
            valid = [d for d in divisors(min(sizes.values())) if all(s % d == 0 for s in sizes.values())]
            why = (f"exceeds {what}={size} of {c.name} (each tp rank needs at least one)" if tp > size
                   else f"does not divide {what}={size} of {c.name}")
            return f"{c.spell('tp', tp)} {why}; choose tp in {_braced(valid)}"
    return None


def _context_split(c: _Check) -> str | None:
    """Context parallelism cuts each sequence into 2*cp head-tail chunks; ``a2a`` (DeepSpeed-Ulysses) also
    gives each of the cp*tp ranks whole heads."""
    lay, m, s = c.layout, c.model, c.spell
    if lay.cp == 1:
        return None
    if m.seq_len % (2 * lay.cp):
        fits = [k for k in range(1, m.seq_len // 2 + 1) if m.seq_len % (2 * k) == 0][:8]
        return (f"{s('cp', lay.cp)} splits each sequence into 2*cp={2 * lay.cp} equal chunks, which "
                f"seq_len={m.seq_len} is not divisible by; choose cp in {_braced(fits)} or a seq_len that is a "
                f"multiple of {2 * lay.cp}")
    ranks = lay.cp * lay.tp
    if lay.cp_impl == "a2a" and (m.n_heads % ranks or m.kv_heads % ranks):
        fits = [k for k in range(1, m.kv_heads + 1) if m.n_heads % (k * lay.tp) == 0 == m.kv_heads % (k * lay.tp)]
        what = f"n_heads={m.n_heads}" + (f" and n_kv_heads={m.kv_heads}" if m.kv_heads != m.n_heads else "")
        return (f"{s('cp_impl', 'a2a')} gives each of cp*tp={ranks} ranks whole heads, but {what} do not divide "
                f"by it; choose cp in {_braced(fits)} with {s('tp', lay.tp)}, or {s('cp_impl', 'ring')}")
    return None


def _sequence_split(c: _Check) -> str | None:
    lay, m = c.layout, c.model
    tokens = m.seq_len // lay.cp
    if not lay.sequence_parallel or tokens % lay.tp == 0:
        return None
    held = f"each cp rank's {tokens} tokens" if lay.cp > 1 else f"the {tokens} tokens of each sequence"
    multiple = 2 * lay.cp * lay.tp if lay.cp > 1 else lay.tp
    return (f"{c.spell('sequence_parallel', True)} splits {held} over {c.spell('tp', lay.tp)}, which does not "
            f"divide them (seq_len={m.seq_len}); choose a seq_len that is a multiple of {multiple} or drop "
            f"{c.spell('sequence_parallel')}")


def experts_problem(ep: int, n_experts: int, spell: Spell, name: str) -> str | None:
    """Why ``ep`` cannot split ``n_experts`` routed experts per layer (0: a dense model), or None. Public for
    a model the API knows only as modules (no :class:`ModelShape`), whose experts it counts itself."""
    if ep == 1:
        return None
    if not n_experts:
        return (f"{spell('ep', ep)} splits the experts of a mixture-of-experts model, and {name} is dense; use an "
                f"MoE model or {spell('ep', 1)}")
    if n_experts % ep:
        return (f"{spell('ep', ep)} does not divide the {n_experts} experts per layer of {name}; choose ep in "
                f"{_braced(divisors(n_experts))}")
    return None


def _experts(c: _Check) -> str | None:
    etp, m = c.layout.etp, c.model
    if etp > 1 and (not m.n_experts or m.expert_ff % etp):
        held = f"experts {m.expert_ff} wide" if m.n_experts else "no routed experts"
        return (f"{c.spell('etp', etp)} splits the hidden width of each routed expert, and {c.name} has {held}; "
                f"choose etp in {_braced(divisors(m.expert_ff) if m.n_experts else [1])}")
    return experts_problem(c.layout.ep, m.n_experts, c.spell, c.name)


MODEL_RULES: tuple[Rule, ...] = (_stage_count, _tensor_split, _context_split, _sequence_split,
                                 _experts)
"""The rules on how the layout splits a model, given its shape."""


def scaled_to_world(layout: Layout, world: int, spell: Spell = keyword) -> Layout:
    """``layout`` on ``world`` ranks by its dp axis alone (``dp_replicate`` following, groups keeping their size), for
    a run the elastic agent restarts on the nodes that remain; refused in one line if no whole dp fits."""
    others, shard = layout.cp * layout.tp * layout.pp, layout.dp // layout.dp_replicate
    if world % others:
        raise LayoutError(f"{spell('elastic', True)}: {world} ranks are not a multiple of cp*tp*pp = {others}, so no "
                       f"whole dp fits; run on a multiple of {others} ranks")
    dp = world // others
    if layout.dp_replicate == 1:
        return dataclasses.replace(layout, dp=dp)
    if dp % shard:
        raise LayoutError(f"{spell('elastic', True)}: dp {dp} on {world} ranks does not split into the hybrid-sharding "
                       f"groups of {shard} ranks ({spell('dp')} / {spell('dp_replicate')}); run on a multiple of "
                       f"{shard * others} ranks")
    return dataclasses.replace(layout, dp=dp, dp_replicate=dp // shard)


def validate(layout: Layout, model: ModelShape | None = None, world_size: int | None = None, *,
             spell: Spell = keyword, name: str = "the model", rules: Sequence[Rule] = MESH_RULES) -> None:
    """Raise :class:`LayoutError` for the first rule ``layout`` breaks, spelled by ``spell``. ``model``
    (called ``name``) and ``world_size`` add their rules when known; ``rules`` narrows to those whose
    settings are known (:data:`MESH_SHAPE_RULES`)."""
    check = _Check(layout, model, world_size, spell, name)
    for rule in (*rules, *(MODEL_RULES if model is not None else ())):
        problem = rule(check)
        if problem:
            raise LayoutError(problem)
