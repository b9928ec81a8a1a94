"""What the planner prices: a :class:`Workload` (one optimizer step of a model shape at a precision, with the
:class:`Pricing` of its kernels) spread over ranks by a :class:`trainmesh.layout.Layout`, the one layout class
the runtime runs, with the checks and per-rank sizes both derive."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from trainmesh.layout import Layout, resolve_reduce_dtype, validate
from trainmesh.models.spec import ModelShape, divisors
from trainmesh.plan.stages import parameter_split
from trainmesh.training.state_bytes import DTYPE_BYTES, Precision, precision_bytes


@dataclass(frozen=True)
class Pricing:
    """How a run's kernels behave where the layout does not say, for pricing published runs (the search never changes
    them): ``a2a_overlap`` [DSV3, 3.2.1], FP8 ``dispatch_dtype`` [DSV3, 3.3.3], ``comm_sm_share`` [DSV3, 3.2.2],
    ``fp8_experts`` [DSV3, 3.3], ``forward_dispatch`` (DeepEP's kernels, at their measured bandwidths),
    ``attention_kernel`` "fa2"/"cudnn"/"fa3" (:data:`~trainmesh.plan.kernels.ATTENTION`; "fa2", the flash kernel
    PyTorch's SDPA and so trainmesh run)."""

    a2a_overlap: bool = False
    dispatch_dtype: str = ""
    comm_sm_share: float = 0.0
    fp8_experts: bool = False
    forward_dispatch: bool = False
    attention_kernel: str = "fa2"

    def __post_init__(self) -> None:
        if self.dispatch_dtype and self.dispatch_dtype not in DTYPE_BYTES:
            raise ValueError(f"dispatch_dtype={self.dispatch_dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.attention_kernel not in ("fa2", "cudnn", "fa3"):
            raise ValueError(f"attention_kernel={self.attention_kernel!r}: choose fa2, cudnn or fa3")
        if not 0 <= self.comm_sm_share < 1:
            raise ValueError(f"comm_sm_share={self.comm_sm_share}: give the share of compute units, in [0, 1)")


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens; precision and ``reduce_dtype`` default to
    :class:`trainmesh.layout.Layout`'s, so a plan holds for the same ``train`` flags. ``documents``: the lengths of
    the documents packed into the sequences (a sample of the data's mix), when attention stays within each one."""

    model: ModelShape
    global_batch: int
    seq_len: int
    precision: str = Layout.precision
    reduce_dtype: str = Layout.reduce_dtype
    pricing: Pricing = Pricing()
    documents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.documents):
            raise ValueError(f"documents={self.documents}: give each document's length in tokens (at least 1)")
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


def local_seq(workload: Workload, layout: Layout) -> int:
    """Tokens of each sequence one rank holds: the sequence split over cp."""
    return workload.seq_len // layout.cp


@functools.lru_cache(maxsize=2**16)  # every estimate of a layout checks it again; a search checks thousands
def check_layout(workload: Workload, layout: Layout) -> None:
    """Raise early, with the fix, when the layout cannot run this workload: the layout's rules on the model
    (at the workload's sequence length and precision, stage splits included), then whole micro-batches."""
    lay = layout
    validate(dataclasses.replace(lay, precision=workload.precision), workload.shape)
    if workload.global_batch % (lay.dp * lay.microbatches):
        raise ValueError(
            f"global_batch={workload.global_batch} is not divisible by dp*microbatches="
            f"{lay.dp * lay.microbatches}; choose dp*microbatches in {divisors(workload.global_batch)}"
        )


def micro_batch_size(workload: Workload, layout: Layout) -> int:
    return workload.global_batch // (layout.dp * layout.microbatches)


def moe_tokens(workload: Workload, layout: Layout) -> int:
    """Tokens one tp rank routes through each MoE layer per micro-batch: all of them without sequence parallelism (the
    layer is whole on every tp rank), a 1/tp slice under it (``trainmesh.models.moe.SequenceSplit``)."""
    tokens = local_seq(workload, layout) * micro_batch_size(workload, layout)
    return tokens // layout.tp if layout.sequence_parallel else tokens


def stage_split(workload: Workload, layout: Layout) -> tuple[int, ...]:
    """Blocks of each of the pp x virtual chunks: ``layout.stage_layers``, else what the runtime does without
    ``--stage-layers`` (:func:`trainmesh.plan.stages.parameter_split`); one chunk without a pipeline."""
    if layout.pp == 1:
        return (workload.model.n_layers,)
    return layout.stage_layers or parameter_split(workload.model, layout.pp * layout.virtual_stages)
