"""One layout of a training run and the rules it must keep, each written once for every front door.

The CLI (:mod:`trainmesh.app.config`), the Python API and the planner each build a :class:`Layout` and
call :func:`validate`, which raises :class:`LayoutError` with one line naming the setting and the fix,
spelled for the audience by a :data:`Spell` (:func:`flag` or :func:`keyword`). This module sits low: it
reads a model only as a :class:`~trainmesh.models.spec.ModelShape`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainmesh.models.spec import ModelShape, divisors

ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")  # trainmesh.pipeline.schedules builds each
RECOMPUTE = ("none", "selective", "full")  # trainmesh.parallel.recompute applies each
PRECISIONS = ("fp32", "bf16", "fp16", "fp64", "fp8")
PRECISION_CHOICES = ("auto", *PRECISIONS)  # what --precision takes: auto resolves by resolve_precision
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp64")
CP_IMPLS = ("ring", "a2a")
AXES = ("dp", "cp", "tp", "pp")  # the mesh axes whose product is the world (ep folds inside them)
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb


class LayoutError(ValueError):
    """A layout that cannot run; the message is one line naming the setting and what to change."""


@dataclass(frozen=True)
class Layout:
    """Every setting a layout rule reads, under the names the command line, API, manifest and planner share: mesh
    sizes (``ep`` folds inside :attr:`token_ranks`), ``dp_replicate``, ZeRO stage, schedule, memory savers and dtypes,
    ``bucket_mb``, ``compile``/``cuda_graphs`` and ``timeline`` (a pipeline picture; empty: none)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    stage_layers: tuple[int, ...] = ()
    recompute: str = "none"
    precision: str = "fp32"
    reduce_dtype: str = "auto"
    cp_impl: str = "ring"
    bucket_mb: float = DEFAULT_BUCKET_MB
    compile: bool = False
    cuda_graphs: bool = False
    timeline: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # as given, or read back from JSON

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes, as the gradient engines cut their buckets."""
        return max(1, int(self.bucket_mb * 2**20))

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
        return self.sequence_parallel and self.tp > 1 and self.ep > 1

    @property
    def expert_data_ranks(self) -> int:
        """Ranks holding the same routed experts, over which their gradients are reduced and ZeRO shards them:
        the token ranks an ep group leaves (dp x cp without experts split)."""
        return self.token_ranks // self.ep if self.ep > 1 else self.grad_ranks

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards over: the ``dp_cp`` ranks of one hybrid-sharding replica group (all of them
        without ``dp_replicate``)."""
        return self.grad_ranks // self.dp_replicate

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks ZeRO shards the routed experts over: :attr:`expert_data_ranks`, or without ep the
        :attr:`shard_ranks` every parameter is sharded over."""
        return self.expert_data_ranks if self.ep > 1 else self.shard_ranks

    @property
    def ep_span(self) -> int:
        """Consecutive ranks an ep group reaches across: ep where it folds over tp, else its ranks lie tp apart."""
        return self.ep if self.experts_over_tp else self.tp * self.ep


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


def _sizes(c: _Check) -> str | None:
    for field in ("dp", "tp", "pp", "cp", "ep", "dp_replicate", "microbatches", "virtual_stages"):
        value = getattr(c.layout, field)
        if value < 1:
            return f"{c.spell(field, value)}: must be at least 1"
    if not 0 < c.layout.bucket_mb < 2**20:  # also refuses NaN
        return f"{c.spell('bucket_mb', c.layout.bucket_mb)}: give a bucket size in MiB, above 0 and below 2**20"
    return None


CHOICES = {"zero": ZERO_STAGES, "schedule": SCHEDULES, "recompute": RECOMPUTE, "precision": PRECISIONS,
           "reduce_dtype": REDUCE_DTYPES, "cp_impl": CP_IMPLS}


def _choices(c: _Check) -> str | None:
    for field, allowed in CHOICES.items():
        value = getattr(c.layout, field)
        if value not in allowed:
            return f"{c.spell(field, value)}: choose {_either(allowed)}"
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
    if lay.token_ranks % lay.ep == 0:
        return None
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
    if lay.ep > 1:
        return (f"{s('dp_replicate', lay.dp_replicate)} with {s('ep', lay.ep)}: hybrid sharding does not split "
                f"the expert-data-parallel groups; use {s('ep', 1)} or drop {s('dp_replicate')}")
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


def _float8_tensor_parallel(c: _Check) -> str | None:
    """trainmesh's tensor-parallel linears run their own bf16 matmuls (torchao's float8 composes with tp only through
    DTensor, as torchtitan's ``Float8ColwiseParallel``), so fp8 and tp are refused together rather than losing float8.
    """
    lay, s = c.layout, c.spell
    if lay.precision == "fp8" and lay.tp > 1:
        return (f"{s('precision', 'fp8')} with {s('tp', lay.tp)}: tensor-parallel linears run their own bf16 "
                f"matmuls, not float8 ones; use {s('tp', 1)} (with dp/zero/pp) or {s('precision', 'bf16')}")
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


MESH_SHAPE_RULES: tuple[Rule, ...] = (_sizes, _choices, _world, _expert_ranks, _hybrid_shards, _sequence_parallel)
"""The rules on the mesh's sizes alone: what ``init_mesh`` checks before the ZeRO stage, the schedule and the
rest are chosen (by ``parallelize``, which checks every rule)."""

MESH_RULES: tuple[Rule, ...] = (*MESH_SHAPE_RULES, _hybrid_needs_zero, _pipeline_only, _virtual_stages,
                                _interleaved_groups, _zero_bubble, _cuda_graphs, _compiled_ring,
                                _float8_tensor_parallel, _stage_layers)
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
    return experts_problem(c.layout.ep, c.model.n_experts, c.spell, c.name)


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
