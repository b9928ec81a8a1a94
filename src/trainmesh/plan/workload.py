"""What the planner prices: a :class:`Workload` (one optimizer step of a model shape at a precision) and a
:class:`Layout` (how that step is spread over ranks), with the checks and per-rank sizes both derive.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from trainmesh.layout import Layout as Settings, LayoutError, resolve_reduce_dtype, validate
from trainmesh.models.spec import ModelShape, divisors
from trainmesh.parallel.zero import DEFAULT_BUCKET_BYTES
from trainmesh.plan.stages import parameter_split
from trainmesh.training.state_bytes import DTYPE_BYTES, Precision, precision_bytes


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens at ``precision``.

    ``reduce_dtype`` is the dtype gradients are accumulated and reduced in, ``auto`` resolved as ``train``
    resolves it; both default to :class:`trainmesh.layout.Layout`'s (the command line's too), so a plan holds
    for the run that ``trainmesh train`` starts with the same flags.
    """

    model: ModelShape
    global_batch: int
    seq_len: int
    precision: str = Settings.precision
    reduce_dtype: str = Settings.reduce_dtype

    def __post_init__(self) -> None:
        for name, value in (("precision", self.precision), ("reduce_dtype", self.reduce_dtype)):
            if value not in DTYPE_BYTES and not (name == "reduce_dtype" and value == "auto"):
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if self.model.learned_positions and self.seq_len > self.model.seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's {self.model.seq_len} learned positions; "
                f"lower seq_len or raise the model's seq_len"
            )

    @functools.cached_property
    def shape(self) -> ModelShape:
        """The model at this workload's sequence length, as the layout's rules read it."""
        return dataclasses.replace(self.model, seq_len=self.seq_len)

    @functools.cached_property
    def dtype_bytes(self) -> Precision:
        return precision_bytes(self.precision, self.grad_dtype)

    @property
    def grad_dtype(self) -> str:
        return resolve_reduce_dtype(self.precision, self.reduce_dtype)


@dataclass(frozen=True)
class Layout:
    """How one step is spread: dp x tp x pp ranks, ZeRO stage, micro-batching and memory savers.

    ``microbatches`` is per data-parallel replica and step (gradient accumulation when pp = 1);
    ``virtual`` is the model chunks per pipeline rank of the interleaved schedule; ``bucket_bytes`` is
    the size of the gradient buckets ZeRO-1/2 reduce-scatter (``--bucket-mb``, counted in parameter bytes);
    ``ep`` splits the routed experts of an MoE model over ranks holding different tokens (dp x cp, and tp under
    sequence parallelism: :attr:`trainmesh.layout.Layout.token_ranks`, which ep divides);
    ``stage_layers`` gives the blocks of each of the pp x virtual chunks (``--stage-layers``; empty: the
    runtime's own split, :func:`stage_split`); ``dp_replicate`` splits dp into that many hybrid-sharding
    (HSDP) replica groups, ZeRO sharding inside each (``--dp-replicate``). ``a2a_overlap`` says the pipeline
    schedule computes another micro-batch while one's expert all-to-all is in flight, as DualPipe pairs a
    forward and a backward chunk of different micro-batches [DeepSeek-V3, 3.2.1]; trainmesh's own schedules
    run one pass at a time, so the search leaves it off and it serves to price a published run whose schedule
    does. Four more settings of that kind describe a run's expert kernels: ``dispatch_dtype`` is the
    dtype tokens go to their experts in, forward and (as gradients) backward, where it is not the activations'
    (DeepSeek-V3 dispatches in FP8 and combines in bf16 [DSV3, 3.3.3]; "": the activations' dtype);
    ``comm_sm_share`` the share of each device's compute units that communication kernels hold throughout the
    step, so that compute runs on the rest (DeepSeek-V3: 20 of 132 SMs [DSV3, 3.2.2]); ``fp8_experts``
    that under ``precision="fp8"`` the routed experts' grouped matmuls run in float8 too, as DeepSeek-V3's
    do [DSV3, 3.3], where trainmesh's stay bf16 (torchao converts ``nn.Linear`` modules only,
    :mod:`trainmesh.training.float8`); and ``forward_dispatch`` that a token bound for experts on another node crosses to
    that node once and is forwarded there over NVLink (DeepSeek-V3's dispatch kernels [DSV3, 3.2.2], DeepEP's
    and HybridEP's), where trainmesh's all-to-all sends each of its top_k copies straight to its rank.
    The defaults are :class:`trainmesh.layout.Layout`'s, and a layout that breaks its rules is refused
    (:class:`~trainmesh.layout.LayoutError`), so the planner only describes layouts the runtime runs.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = Settings.zero
    microbatches: int = Settings.microbatches
    schedule: str = Settings.schedule
    virtual: int = Settings.virtual_stages
    recompute: str = Settings.recompute
    sequence_parallel: bool = Settings.sequence_parallel
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    cp: int = 1
    cp_impl: str = Settings.cp_impl
    ep: int = 1
    stage_layers: tuple[int, ...] = ()
    a2a_overlap: bool = False
    dp_replicate: int = Settings.dp_replicate
    dispatch_dtype: str = ""
    comm_sm_share: float = 0.0
    fp8_experts: bool = False
    forward_dispatch: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # as given, or read back from JSON
        if self.bucket_bytes < 1:
            raise LayoutError(f"bucket_bytes={self.bucket_bytes}: must be at least 1")
        if self.dispatch_dtype and self.dispatch_dtype not in DTYPE_BYTES:
            raise LayoutError(f"dispatch_dtype={self.dispatch_dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if not 0 <= self.comm_sm_share < 1:
            raise LayoutError(f"comm_sm_share={self.comm_sm_share}: give the share of compute units, in [0, 1)")
        validate(self.settings)

    @functools.cached_property
    def settings(self) -> Settings:
        """This layout as :mod:`trainmesh.layout` states it, for its rules and the sizes it derives (built
        once: the estimates read ``world`` and ``grad_ranks`` for every stage of every candidate)."""
        return Settings(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero=self.zero,
                        sequence_parallel=self.sequence_parallel, schedule=self.schedule,
                        virtual_stages=self.virtual, microbatches=self.microbatches, recompute=self.recompute,
                        cp_impl=self.cp_impl, stage_layers=self.stage_layers, dp_replicate=self.dp_replicate)

    @property
    def world(self) -> int:
        return self.settings.world

    @property
    def grad_ranks(self) -> int:
        return self.settings.grad_ranks

    @property
    def experts_over_tp(self) -> bool:
        return self.settings.experts_over_tp

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks ZeRO shards the routed experts over (:attr:`trainmesh.layout.Layout.expert_data_ranks`; without
        ep, the :attr:`shard_ranks` every parameter is sharded over)."""
        return self.settings.expert_data_ranks if self.ep > 1 else self.shard_ranks

    @property
    def ep_span(self) -> int:
        """Consecutive ranks an ep group reaches across: ep where it folds over tp, else its ranks lie tp apart."""
        return self.ep if self.experts_over_tp else self.tp * self.ep

    @property
    def shard_ranks(self) -> int:
        return self.settings.shard_ranks


def local_seq(workload: Workload, layout: Layout) -> int:
    """Tokens of each sequence one rank holds: the sequence split over cp."""
    return workload.seq_len // layout.cp


@functools.lru_cache(maxsize=2**16)  # every estimate of a layout checks it again; a search checks thousands
def check_layout(workload: Workload, layout: Layout) -> None:
    """Raise early, with the fix, when the layout cannot run this workload: the layout's rules on the model
    (at the workload's sequence length and precision, stage splits included), then whole micro-batches."""
    lay = layout
    validate(dataclasses.replace(lay.settings, precision=workload.precision), workload.shape)
    if workload.global_batch % (lay.dp * lay.microbatches):
        raise ValueError(
            f"global_batch={workload.global_batch} is not divisible by dp*microbatches="
            f"{lay.dp * lay.microbatches}; choose dp*microbatches in {divisors(workload.global_batch)}"
        )


def micro_batch_size(workload: Workload, layout: Layout) -> int:
    return workload.global_batch // (layout.dp * layout.microbatches)


def moe_tokens(workload: Workload, layout: Layout) -> int:
    """Tokens one tp rank routes through each MoE layer per micro-batch. The MoE layer is whole on every tp
    rank, so without sequence parallelism each tp rank routes all of its micro-batch's tokens (the same
    work on every tp rank); under sequence parallelism the MoE layer sits in the sequence-split region
    and each tp rank routes only its 1/tp slice of every sequence (``trainmesh.models.moe.SequenceSplit``)."""
    tokens = local_seq(workload, layout) * micro_batch_size(workload, layout)
    return tokens // layout.tp if layout.sequence_parallel else tokens


def stage_split(workload: Workload, layout: Layout) -> tuple[int, ...]:
    """Blocks of each of the pp x virtual chunks: ``layout.stage_layers``, else what the runtime does without
    ``--stage-layers`` (:func:`trainmesh.plan.stages.parameter_split`); one chunk without a pipeline."""
    if layout.pp == 1:
        return (workload.model.n_layers,)
    return layout.stage_layers or parameter_split(workload.model, layout.pp * layout.virtual)
