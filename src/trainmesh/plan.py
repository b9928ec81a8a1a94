"""Predict, before launching, whether a layout fits in memory and how long one step takes; pick the best.

Every estimate is a plain function of (model shape, workload, layout, cluster), so the same functions that
rank layouts can be checked against measured memory and step times. Each formula cites its source:

* [ZeRO]  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020.
* [KOR]   Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022.
* [NAR]   Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
          Megatron-LM", 2021; "app. FLOPs" is its appendix deriving F = 96Bslh^2(1 + s/6h + V/16lh).
* [ZB]    Qi et al., "Zero Bubble Pipeline Parallelism", 2023.
* [THA]   Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH", 2005.
* [PALM]  Chowdhery et al., "PaLM", 2022, appendix B (model FLOPs utilization).

Conventions the estimates share with the trainmesh runtime (change them together):

* Ranks are ordered tp fastest, then dp, then pp (Megatron's default), so a tp group is ``tp``
  consecutive ranks, a dp group spans ``tp * dp`` and a pipeline spans the whole world.
* A ZeRO unit is one top-level piece of :class:`trainmesh.models.gpt.GPT` (``embed``, each block,
  ``ln_f``, ``head``); each unit's flat shard is padded up to a multiple of the dp size.
* A pipeline stage owns ``n_layers / pp`` consecutive blocks (``virtual`` chunks of them when
  interleaved); stage 0 also owns the embeddings, the last stage ``ln_f`` and the head.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import Iterator

from trainmesh.app.config import Config
from trainmesh.layout import (RECOMPUTE, ZERO_STAGES, Layout as Settings, LayoutError, resolve_reduce_dtype,
                              validate)
from trainmesh.metrics import (DEVICE_PEAKS, DevicePeak, block_flops_per_token, head_flops_per_token,
                               model_flops_per_token)
from trainmesh.models import PRESET_NAMES, ModelShape, planner_shapes, spec_of

LONG_SEQUENCE = 16384  # from here on the search also tries context parallelism
MIN_CP_CHUNK = 1024  # tokens per head-tail chunk below which cp is not tried
GIB = 2**30


# ----------------------------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------------------------


def _gpt3_like(n_layers: int, d_model: int, n_heads: int) -> ModelShape:
    """A Megatron GPT shape [NAR, Table 1]: d_ff = 4h, vocab 51200 (GPT-2's padded), sequence 2048,
    dropout, attention that stores its score matrix."""
    return ModelShape(n_layers, d_model, n_heads, 4 * d_model, 51200, 2048, dropout=True,
                      flash_attention=False)


def _llama_moe(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab: int, experts: int,
               top_k: int, d_ff_expert: int, shared: int = 0, dense_layers: int = 0) -> ModelShape:
    """A Llama-family mixture of experts (SwiGLU experts, RMSNorm, RoPE, untied head), planned at 4096
    tokens per sequence, the pretraining length of DeepSeek-V3 and of Qwen3's first stage (``--seq``
    changes it). Head size is d_model / n_heads here, as in every trainmesh shape."""
    return ModelShape(n_layers, d_model, n_heads, d_ff, vocab, 4096, gated_mlp=True, bias=False,
                      learned_positions=False, n_kv_heads=n_kv_heads, n_experts=experts, top_k=top_k,
                      n_shared_experts=shared, d_ff_expert=d_ff_expert, n_dense_layers=dense_layers)


MODEL_PRESETS: dict[str, ModelShape] = {
    **planner_shapes(),
    # Planning-only shapes of a family trainmesh does not build (Megatron's GPT, with dropout).
    "gpt3-175b": _gpt3_like(96, 12288, 96),
    "megatron-530b": _gpt3_like(105, 20480, 128),
    "megatron-1t": _gpt3_like(128, 25600, 160),
    # Mixtures of experts trainmesh does not build, from the published Hugging Face configs (Mixtral-8x7B is
    # a buildable llama-moe preset): Qwen3-30B-A3B (Qwen3 technical report, 2025; 30.5B / 3.3B; its 128-wide heads at
    # d 2048 are 64-wide here, which undercounts its attention by 0.45B parameters) and DeepSeek-V3
    # (DeepSeek-AI, 2024; 671B / 37B; 256 routed experts and 1 shared, top-8, the first 3 layers dense; its
    # multi-head latent attention is planned as plain multi-head attention of 128 heads, which has about
    # its parameter count: 205M against 187M per layer).
    "qwen3-30b-a3b": _llama_moe(48, 2048, 32, 4, 6144, 151936, experts=128, top_k=8, d_ff_expert=768),
    "deepseek-v3": _llama_moe(61, 7168, 128, 128, 18432, 129280, experts=256, top_k=8, d_ff_expert=2048,
                              shared=1, dense_layers=3),
}


def model_shape(name: str) -> ModelShape:
    """Look a model preset up by name, with the list of valid names in the error."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}") from None


# ----------------------------------------------------------------------------------------------------------
# Cluster, precision, workload, layout
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """Devices and links. Bandwidths are bytes/s per device in one direction (``inter_bw`` is one NIC's),
    latencies are per ring hop, and ``reserved_bytes`` of each device's memory are not available to the
    model (runtime, fragmentation).

    How close the device gets to those figures: a matmul reaches ``gemm_efficiency`` of peak when all of
    its dimensions are large, and each dimension d scales that by d / (d + ``gemm_half_dim``)
    (:func:`gemm_efficiency`); collectives move data at ``comm_efficiency`` of the link bandwidth.
    ``ranks_per_core`` > 1 means CPU processes sharing fewer cores (:func:`step_time`).
    """

    gpus: int
    gpus_per_node: int
    mem_bytes: int
    peak_flops: float
    peak_flops_fp32: float
    intra_bw: float
    inter_bw: float
    intra_latency: float
    inter_latency: float
    gemm_efficiency: float
    gemm_half_dim: int
    comm_efficiency: float
    reserved_bytes: int
    ranks_per_core: float = 1.0

    def __post_init__(self) -> None:
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node}; "
                f"use a multiple of gpus_per_node"
            )

    @property
    def usable_bytes(self) -> int:
        return self.mem_bytes - self.reserved_bytes

    def link(self, span: int) -> tuple[float, float]:
        """(achieved bandwidth, latency) of a group of ``span`` consecutive ranks: NVLink inside a node, NIC
        beyond."""
        if span <= self.gpus_per_node:
            return self.intra_bw * self.comm_efficiency, self.intra_latency
        return self.inter_bw * self.comm_efficiency, self.inter_latency


def _gpu_node(mem_bytes: int, peak: DevicePeak, nvlink: float, nic: float) -> Cluster:
    """One 8-GPU node from datasheet figures.

    The efficiencies are :data:`GPU_EFFICIENCY`, fitted to Megatron-LM's weak-scaling table [NAR, Table 1]
    (``tests/test_plan.py`` holds the table and checks the fit). NCCL's per-hop latency is about 2 us over
    NVLink and 10 us over InfiniBand; 2 GiB stay reserved for the CUDA context, NCCL's own buffers and
    allocator fragmentation.
    """
    gemm, half_dim, comm = GPU_EFFICIENCY
    return Cluster(gpus=8, gpus_per_node=8, mem_bytes=mem_bytes, peak_flops=peak.half,
                   peak_flops_fp32=peak.fp32, intra_bw=nvlink, inter_bw=nic, intra_latency=2e-6,
                   inter_latency=10e-6, gemm_efficiency=gemm, gemm_half_dim=half_dim, comm_efficiency=comm,
                   reserved_bytes=2 * GIB)


# (gemm_efficiency, gemm_half_dim, comm_efficiency) of a GPU, the least-squares-in-the-worst-case fit to the
# ten rows of [NAR, Table 1] (1.7B to 1T parameters on up to 3072 A100-80GB): every row within 6 %. Large
# matmuls reach 72 % of the 16-bit peak (225 of 312 TFLOP/s, what cuBLAS sustains with Megatron's fused
# epilogues); a dimension of 160 halves that, so the attention core's head_dim-wide matmuls (64-160) run at
# a third to a half of it, which is what makes small models slow; NCCL reaches 70 % of the link bandwidth.
# No published table of that kind exists for H100/H200 here, so they take the A100 fit.
GPU_EFFICIENCY = (0.72, 160, 0.7)


# Peaks from metrics.DEVICE_PEAKS, NVLink bandwidth per direction, one 200 Gb/s (A100) or 400 Gb/s
# (H100/H200) NIC per GPU. "cpu" is one core per process at 100 GFLOP/s fp32 peak, fitted to
# ``python -m trainmesh.app.bench.plan --model small`` on a 2-core host: matmuls of a few hundred rows reach
# 65 % of it, and Gloo's collectives between processes move 0.37 GB/s with 2.7 ms per ring step (its threads
# hand work over on the cores the ranks compute on); across hosts no better than that.
CLUSTER_PRESETS: dict[str, Cluster] = {
    "a100-40gb": _gpu_node(40 * GIB, DEVICE_PEAKS["A100"], 300e9, 25e9),
    "a100-80gb": _gpu_node(80 * GIB, DEVICE_PEAKS["A100"], 300e9, 25e9),
    "h100-80gb": _gpu_node(80 * GIB, DEVICE_PEAKS["H100"], 450e9, 50e9),
    "h200-141gb": _gpu_node(141 * 10**9, DEVICE_PEAKS["H200"], 450e9, 50e9),
    "cpu": Cluster(gpus=8, gpus_per_node=8, mem_bytes=16 * GIB, peak_flops=1e11, peak_flops_fp32=1e11,
                   intra_bw=0.37e9, inter_bw=0.37e9, intra_latency=2.7e-3, inter_latency=2.7e-3,
                   gemm_efficiency=0.65, gemm_half_dim=32, comm_efficiency=1.0, reserved_bytes=GIB),
}


def make_cluster(
    gpu: str,
    gpus: int,
    gpus_per_node: int | None = None,
    *,
    mem_gb: float | None = None,
    peak_tflops: float | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
) -> Cluster:
    """A preset resized to ``gpus`` devices, with any explicit figure (GiB, TFLOP/s, GB/s) overriding it."""
    try:
        base = CLUSTER_PRESETS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu preset {gpu!r}; choose one of {', '.join(CLUSTER_PRESETS)}") from None
    per_node = gpus_per_node or min(gpus, base.gpus_per_node)
    overrides = {
        "mem_bytes": None if mem_gb is None else int(mem_gb * GIB),
        "peak_flops": None if peak_tflops is None else peak_tflops * 1e12,
        "intra_bw": None if intra_gbps is None else intra_gbps * 1e9,
        "inter_bw": None if inter_gbps is None else inter_gbps * 1e9,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base, gpus=gpus, gpus_per_node=per_node, **given)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each state; ``optimizer`` is the ZeRO paper's K [ZeRO, sec. 3.1]."""

    param: int
    grad: int
    optimizer: int
    activation: int


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
FULL_PRECISIONS = ("fp32", "fp64")  # parameters are their own master weights
STEP_SCALAR_BYTES = 4  # AdamW keeps one float32 ``step`` tensor per parameter tensor.


@functools.cache
def precision_bytes(precision: str, reduce_dtype: str) -> Precision:
    """Parameters and activations in ``precision``, gradients in ``reduce_dtype``.

    fp32 training keeps Adam's two moments (K = 8; fp64: 16); mixed precision adds fp32 master weights
    (K = 12) [ZeRO, 3.1]. The ZeRO paper's 2 Psi of gradients assumes they are reduced in the low
    precision; trainmesh's default fp32 reduction (Megatron's ``main_grad``) holds 4 Psi instead.
    """
    size = DTYPE_BYTES[precision]
    return Precision(size, DTYPE_BYTES[reduce_dtype], 2 * size if precision in FULL_PRECISIONS else 12, size)


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
    ``ep`` splits the routed experts of an MoE model over ranks of the dp x cp group (so ep divides it).
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
    bucket_bytes: int = int(Config.bucket_mb * 2**20)
    cp: int = 1
    cp_impl: str = Settings.cp_impl
    ep: int = 1

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise LayoutError(f"bucket_bytes={self.bucket_bytes}: must be at least 1")
        validate(self.settings)

    @property
    def settings(self) -> Settings:
        """This layout as :mod:`trainmesh.layout` states it, for its rules."""
        return Settings(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero=self.zero,
                        sequence_parallel=self.sequence_parallel, schedule=self.schedule,
                        virtual_stages=self.virtual, microbatches=self.microbatches, recompute=self.recompute,
                        cp_impl=self.cp_impl)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def grad_ranks(self) -> int:
        """Ranks over which gradients are reduced and ZeRO shards: dp x cp (Megatron's dp-cp group)."""
        return self.dp * self.cp


def local_seq(workload: Workload, layout: Layout) -> int:
    """Tokens of each sequence one rank holds: the sequence split over cp."""
    return workload.seq_len // layout.cp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=2**16)  # every estimate of a layout checks it again; a search checks thousands
def check_layout(workload: Workload, layout: Layout) -> None:
    """Raise early, with the fix, when the layout cannot run this workload: the layout's rules on the model
    (at the workload's sequence length), then what the estimates assume (whole stages of equal depth, whole
    micro-batches)."""
    m, lay = workload.model, layout
    validate(lay.settings, workload.shape)
    if m.n_layers % (lay.pp * lay.virtual):
        raise ValueError(
            f"n_layers={m.n_layers} is not divisible by pp*virtual={lay.pp * lay.virtual}; "
            f"choose pp*virtual in {_divisors(m.n_layers)}"
        )
    if workload.global_batch % (lay.dp * lay.microbatches):
        raise ValueError(
            f"global_batch={workload.global_batch} is not divisible by dp*microbatches="
            f"{lay.dp * lay.microbatches}; choose dp*microbatches in {_divisors(workload.global_batch)}"
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


# ----------------------------------------------------------------------------------------------------------
# Parameters per rank
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """Parameters one rank holds of one ZeRO unit after tensor parallelism: elements and tensors."""

    numel: int
    tensors: int


def _norm(m: ModelShape) -> Unit:
    """LayerNorm (weight and bias) or RMSNorm (weight only); replicated across tp ranks."""
    return Unit(m.d_model * (2 if m.bias else 1), 2 if m.bias else 1)


def _linear(n_in: int, n_out: int, tp: int, bias: bool, bias_sharded: bool) -> Unit:
    """A Megatron-sharded linear: weight split by tp, column-parallel bias split, row-parallel bias not."""
    bias_numel = (n_out // tp if bias_sharded else n_out) if bias else 0
    return Unit(n_in * n_out // tp + bias_numel, 2 if bias else 1)


def _sum(units: list[Unit]) -> Unit:
    return Unit(sum(u.numel for u in units), sum(u.tensors for u in units))


def _mlp(m: ModelShape, f: int, tp: int, bias: bool) -> list[Unit]:
    """An MLP of hidden size ``f``: input projection(s) column-parallel, output row-parallel [NAR, 2.3]."""
    d = m.d_model
    return [_linear(d, f, tp, bias, True)] * (2 if m.gated_mlp else 1) + [_linear(f, d, tp, bias, False)]


def block_unit(m: ModelShape, tp: int, moe: bool = False) -> Unit:
    """One block: qkv and MLP-in are column-parallel, attention and MLP out row-parallel [NAR, 2.3]. An MoE
    block (``moe``) holds here what every ep rank holds of it: the router and the shared experts' MLP in
    place of the dense one, both whole on every tp rank (the MoE families' tp plans leave the MoE layer
    out: ``trainmesh.parallel.expert_parallel.moe_tp_plan``); its routed experts are :func:`expert_unit`."""
    d, b = m.d_model, m.bias
    attention = [_norm(m), _linear(d, m.qkv_width, tp, b, True), _linear(d, d, tp, b, False), _norm(m)]
    return _sum(attention + ([router_and_shared(m)] if moe else _mlp(m, m.d_ff, tp, b)))


def router_and_shared(m: ModelShape) -> Unit:
    """What an MoE layer holds besides its routed experts: the router and the shared experts, whole on
    every tp rank."""
    shared = _mlp(m, m.n_shared_experts * m.expert_ff, 1, m.bias) if m.n_shared_experts else []
    return _sum([Unit(m.d_model * m.n_experts, 1)] + shared)


def expert_unit(m: ModelShape, ep: int) -> Unit:
    """The routed experts one rank holds of one MoE layer: n_experts / ep of them, stacked (one tensor per
    projection), each whole: trainmesh splits experts over ep only, never over tp (no expert tensor
    parallelism, unlike Megatron-core's default expert tp = tp), so every tp rank holds the same experts."""
    return Unit(m.n_experts // ep * m.mlp_params(m.expert_ff, False), 3 if m.gated_mlp else 2)


def stage_blocks(m: ModelShape, pp: int, stage: int) -> tuple[int, int]:
    """(dense, MoE) blocks on one rank of ``stage``: the first ``n_dense_layers`` of the model are dense."""
    per = m.n_layers // pp
    if not m.n_experts:
        return per, 0
    dense = max(0, min(m.n_dense_layers, (stage + 1) * per) - stage * per)
    return dense, per - dense


def embed_unit(m: ModelShape, tp: int) -> Unit:
    """Vocab-parallel token table plus the replicated learned positions."""
    positions = m.seq_len * m.d_model if m.learned_positions else 0
    return Unit(m.vocab_size * m.d_model // tp + positions, 2 if m.learned_positions else 1)


def head_unit(m: ModelShape, tp: int) -> Unit:
    """Vocab-parallel output projection without bias; nothing of its own when tied to the embedding."""
    return Unit(0, 0) if m.tied_embeddings else Unit(m.d_model * m.vocab_size // tp, 1)


@functools.cache
def stage_units(m: ModelShape, tp: int, pp: int, stage: int) -> tuple[tuple[Unit, int], ...]:
    """(unit, how many) one rank of ``stage`` holds; interleaving changes which blocks, not how many.

    Cached: a search asks for the same few stages of one model thousands of times.
    """
    first = ((embed_unit(m, tp), 1),) if stage == 0 else ()
    last = ((_norm(m), 1), (head_unit(m, tp), 1)) if stage == pp - 1 else ()
    dense, moe = stage_blocks(m, pp, stage)
    blocks = ((block_unit(m, tp), dense),) if dense else ()
    blocks += ((block_unit(m, tp, moe=True), moe),) if moe else ()
    return blocks + first + last


def stage_expert_units(m: ModelShape, pp: int, ep: int, stage: int) -> tuple[tuple[Unit, int], ...]:
    """(routed experts of one MoE layer, how many layers) one rank of ``stage`` holds; empty for a dense
    model. The same at every tp: experts are whole on each tp rank (:func:`expert_unit`)."""
    moe = stage_blocks(m, pp, stage)[1]
    return ((expert_unit(m, ep), moe),) if moe else ()


def largest_tensor(m: ModelShape, tp: int, ep: int = 1) -> int:
    """Elements of the largest parameter tensor one tp rank holds: a gradient bucket holds at least one."""
    linears = [m.d_model * m.qkv_width, m.d_model * m.d_ff, m.d_model * m.vocab_size]
    experts = m.n_experts // ep * m.d_model * m.expert_ff if m.n_experts else 0
    positions = m.seq_len * m.d_model if m.learned_positions else 0
    return max(max(linears) // tp, experts, positions)


def params_per_tp_rank(m: ModelShape, tp: int) -> int:
    """Parameters per tp rank of the whole model (all stages, all experts)."""
    units = stage_units(m, tp, 1, 0) + stage_expert_units(m, 1, 1, 0)
    return sum(u.numel * n for u, n in units)


def active_params(m: ModelShape) -> int:
    """Parameters one token's forward uses: all of a dense model; of an MoE model, ``top_k`` of each MoE
    layer's ``n_experts`` routed experts (the shared ones always). FLOPs follow these, memory the total."""
    idle = (m.n_experts - m.top_k) * m.mlp_params(m.expert_ff, False) if m.n_experts else 0
    return m.n_params() - (m.n_layers - m.n_dense_layers) * idle


# ----------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank of ``stage`` holds at its peak: model state, activations in flight, and transients.

    ``buffers`` are all communication buffers (:func:`buffer_bytes`), ``p2p`` the pipeline's part of them,
    ``logits`` what the loss holds while it runs (:func:`logits_bytes`).
    """

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    p2p: int
    logits: int

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def transients(self) -> int:
        """The larger of the two moments transients peak. The loss runs at the end of a micro-batch's
        forward, when ZeRO holds no gathered unit (each is freed after its forward) and no gradient bucket
        (they fill during backward), but a pipeline's receive may be posted: logits plus p2p buffers. In
        backward the logits are gone and every buffer may be in use."""
        return max(self.buffers, self.p2p + self.logits)

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.transients


@functools.lru_cache(maxsize=4096)
def _model_state(
    workload: Workload, tp: int, pp: int, dp: int, zero: int, stage: int, ep: int = 1
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of one rank [ZeRO, sec. 5, Fig. 1].

    Unsharded each costs its bytes per element times Psi, together (2 + 2 + K) Psi in mixed precision.
    Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters, each
    over the dp ranks; a unit's shard is ceil(Psi_unit / dp) elements because the flat buffer is padded.
    Routed experts are already split over ep, so ZeRO shards them over the dp / ep ranks that hold the
    same experts (the expert-data-parallel group, as Megatron-core and torchtitan do).
    Cached: a search meets the same (tp, pp, dp, zero) under every schedule and micro-batch size.
    """
    b, m = workload.dtype_bytes, workload.model
    groups = ((stage_units(m, tp, pp, stage), dp), (stage_expert_units(m, pp, ep, stage), dp // ep))
    full = sum(u.numel * n for units, _ in groups for u, n in units)
    shard = sum(-(-u.numel // ranks) * n for units, ranks in groups for u, n in units)
    steps = STEP_SCALAR_BYTES * sum(u.tensors * n for units, _ in groups for u, n in units)
    params = b.param * (shard if zero >= 3 else full)
    grads = b.grad * (shard if zero >= 2 else full)
    optimizer = b.optimizer * (shard if zero >= 1 else full) + steps
    return params, grads, optimizer


def layer_activation_bytes(workload: Workload, layout: Layout, recompute: str | None = None,
                           moe: bool = False) -> int:
    """Bytes one block keeps for backward per micro-batch, item by item from [KOR, sec. 4.1].

    With dropout and 2-byte activations this is exactly sbh(34 + 5as/h) (eq. 1), sbh(10 + 24/t + 5as/(ht))
    under tensor parallelism (eq. 2), sbh/t (34 + 5as/h) with sequence parallelism (eq. 3), and the
    5as/h term disappears with selective recomputation (eq. 6) or a fused attention kernel. Full
    recomputation keeps only each block's input, 2sbh (sec. 5), split by t under sequence parallelism.
    Other MLP widths and a gated MLP replace the two 4h-wide GeLU tensors by two (or four) f-wide ones.
    An MoE block (``moe``) keeps its experts' inner tensors for the top_k copies of each token (and the
    shared experts' for every token), the copies' inputs and outputs (2 top_k sbh) and the router's scores
    (sbE), none of it split by tp: the experts are whole on every tp rank, which routes all its tokens
    (only sequence parallelism splits them: :func:`moe_tokens`).
    """
    m, t, e = workload.model, layout.tp, workload.dtype_bytes.activation
    recompute = recompute or layout.recompute
    sbh = local_seq(workload, layout) * micro_batch_size(workload, layout) * m.d_model
    seq_split = t if layout.sequence_parallel else 1
    if recompute == "full":
        return e * sbh // seq_split
    # Norm inputs, qkv and MLP inputs, dropout masks: only sequence parallelism splits these.
    seq_sharded = 4 * e * sbh + (2 * sbh if m.dropout else 0)
    # Q, K, V, the attention projection's input, a dense MLP's inner activations: split by heads or columns.
    # (K and V are kv_heads/n_heads of Q's size under grouped-query attention.)
    qkv_and_proj_input = e * sbh * (m.qkv_width + m.d_model) // m.d_model
    width = (m.top_k + m.n_shared_experts) * m.expert_ff if moe else m.d_ff
    inner = (4 if m.gated_mlp else 2) * e * sbh * width // m.d_model
    experts = (2 * m.top_k * e * sbh + e * sbh * m.n_experts // m.d_model + inner) // seq_split
    mlp_inner, routed = (0, experts) if moe else (inner, 0)
    scores = m.n_heads * workload.seq_len * sbh // m.d_model
    stores_scores = recompute == "none" and not m.flash_attention
    core = scores * (e + (1 + e if m.dropout else 0)) if stores_scores else 0
    return seq_sharded // seq_split + routed + (qkv_and_proj_input + mlp_inner + core
                                                + cp_attention_output(workload, layout)) // t


def cp_attention_output(workload: Workload, layout: Layout) -> int:
    """What context-parallel attention keeps beside the projection's input (measured by ``bench.cp``): the
    ring its merged output in the accumulation dtype (fp32 or wider) and its log-sum-exp; Ulysses the
    core's output, still in head-split order. 0 without cp."""
    if layout.cp == 1:
        return 0
    e = workload.dtype_bytes.activation
    tokens = local_seq(workload, layout) * micro_batch_size(workload, layout)
    if layout.cp_impl == "a2a":
        return e * tokens * workload.model.d_model
    wide = max(e, DTYPE_BYTES["fp32"])
    return wide * tokens * (workload.model.d_model + workload.model.n_heads)


def in_flight_chunks(layout: Layout, stage: int) -> int:
    """Micro-batch chunks (n_layers / (pp * virtual) blocks each) whose activations ``stage`` holds at once.

    GPipe keeps all m micro-batches; 1F1B keeps min(p - stage, m); ZB-H1 defers weight gradients, so
    every stage keeps min(p, m), 1F1B's peak [ZB, 3.1]; Megatron's interleaved schedule runs
    2(p - stage - 1) + (v - 1)p warm-up chunks plus one, so stage 0 holds L(1 + (p - 1)/(pv)) blocks'
    worth [NAR, 2.2.2; KOR, 4.2.2]. These are the peaks ``Timeline.peak_activations`` of
    :mod:`trainmesh.pipeline.simulate` reports for those schedules.
    """
    p, m, v = layout.pp, layout.microbatches, layout.virtual
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    return min(p if layout.schedule == "zb" else p - stage, m)


def _stage_extras(workload: Workload, layout: Layout, stage: int) -> tuple[int, int]:
    """(first, last): what one micro-batch saves outside the blocks on ``stage`` [KOR, sec. 4.3].

    Stage 0 keeps the embedding dropout masks (sbh); the last stage keeps the final norm and head inputs
    (2 x e sbh) and the fp32 logits (4sbv/t) that the loss saves.
    """
    m, e, lay = workload.model, workload.dtype_bytes.activation, layout
    sbh = local_seq(workload, lay) * micro_batch_size(workload, lay) * m.d_model
    seq_split = lay.tp if lay.sequence_parallel else 1
    first = sbh // seq_split if stage == 0 and m.dropout else 0
    last = 2 * e * sbh // seq_split + 4 * sbh * m.vocab_size // (m.d_model * lay.tp) if stage == lay.pp - 1 else 0
    return first, last


def _stage_block_bytes(workload: Workload, layout: Layout, stage: int, recompute: str | None = None) -> int:
    """What all blocks of ``stage`` keep for one micro-batch: its dense and its MoE blocks."""
    dense, moe = stage_blocks(workload.model, layout.pp, stage)
    return (dense * layer_activation_bytes(workload, layout, recompute)
            + (moe * layer_activation_bytes(workload, layout, recompute, moe=True) if moe else 0))


def _micro_batch_activation_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    first, last = _stage_extras(workload, layout, stage)
    return _stage_block_bytes(workload, layout, stage) + first + last


def _activation_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    """Peak activation bytes of one rank of ``stage`` [KOR, sec. 4.2-4.3].

    Blocks in flight times the per-block cost, plus :func:`_stage_extras`: stage 0's for every
    micro-batch in flight, the last stage's for one micro-batch since its backward follows its forward at
    once (all m under GPipe). Recomputation needs one block's full activations back while that block
    runs backward, so that working set is added once.
    """
    lay = layout
    chunks = in_flight_chunks(lay, stage)
    moe = stage_blocks(workload.model, lay.pp, stage)[1] > 0
    working = (layer_activation_bytes(workload, lay, "none", moe) - layer_activation_bytes(workload, lay, None, moe)
               if lay.recompute != "none" else 0)
    first, last = _stage_extras(workload, lay, stage)
    total = chunks * (_stage_block_bytes(workload, lay, stage) // lay.virtual) + working
    total += -(-chunks // lay.virtual) * first
    return total + (lay.microbatches if lay.schedule == "gpipe" else 1) * last


def logits_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    """The logits alive while the last stage's loss runs (0 on other stages): the head's output in the
    activation dtype, s b v / t elements, and the fp32 copy the loss computes in unless that dtype is fp32.

    Neither is saved for backward (the loss saves its own fp32 result, which :func:`_stage_extras` counts
    as [KOR, 4.3] does), so they are not activations in flight: they add to the peak for one micro-batch,
    while the loss runs (:attr:`MemoryBreakdown.transients`).
    """
    if stage != layout.pp - 1:
        return 0
    sbv = local_seq(workload, layout) * micro_batch_size(workload, layout) * workload.model.vocab_size // layout.tp
    copies = workload.dtype_bytes.activation + (0 if workload.precision == "fp32" else DTYPE_BYTES["fp32"])
    return copies * sbv


def buffer_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    """Transient communication buffers.

    ZeRO-3 gathers the current and the prefetched unit and holds one unit's full gradient before the
    reduce-scatter [ZeRO, 5.3]. ZeRO-2 reduce-scatters gradients in constant-size buckets [ZeRO, 5.2 and
    6.2 "CB"]: the one filling and the one in flight, ``bucket_bytes`` of parameters each but at most
    1/(2N) of the stage's gradients (``zero.stage2_bucket_bytes``, so that stage 2 never holds them all at
    once), and at least one whole tensor. A pipeline
    stage adds :func:`p2p_bytes`.
    """
    b, m, lay = workload.dtype_bytes, workload.model, layout
    units = stage_units(m, lay.tp, lay.pp, stage) + stage_expert_units(m, lay.pp, lay.ep, stage)
    largest = max(u.numel for u, _ in units)
    gathered = 2 * b.param * largest if layout.zero >= 3 else 0
    if layout.zero == 2:
        stage_elems = sum(u.numel * n for u, n in units)
        bucket_bytes = min(layout.bucket_bytes, b.grad * stage_elems // (2 * layout.grad_ranks))  # the runtime's cap
        buckets = max(2 * bucket_bytes // b.param, largest_tensor(workload.model, layout.tp, layout.ep))
        unit_grad = b.grad * min(buckets, stage_elems)
    else:
        unit_grad = b.grad * largest if layout.zero == 3 else 0
    return gathered + unit_grad + p2p_bytes(workload, layout)


def p2p_bytes(workload: Workload, layout: Layout) -> int:
    """A pipeline stage's send and receive buffer of a micro-batch's boundary activation, split by t
    [NAR, 4.1 scatter/gather]; 0 without a pipeline."""
    boundary = local_seq(workload, layout) * micro_batch_size(workload, layout) * workload.model.d_model // layout.tp
    return 2 * workload.dtype_bytes.activation * boundary if layout.pp > 1 else 0


def _stage_memory(workload: Workload, layout: Layout, stage: int) -> MemoryBreakdown:
    params, grads, optimizer = _model_state(workload, layout.tp, layout.pp, layout.grad_ranks, layout.zero, stage,
                                            layout.ep)
    acts = _activation_bytes(workload, layout, stage)
    return MemoryBreakdown(stage, params, grads, optimizer, acts, buffer_bytes(workload, layout, stage),
                           p2p_bytes(workload, layout), logits_bytes(workload, layout, stage))


def _stages(layout: Layout, stage: int | None, model: ModelShape | None = None) -> list[int]:
    """The stage asked for, or the only ones that can be worst.

    Middle stages hold the same blocks as the first or last, without the embeddings or head, and no
    more micro-batches in flight than stage 0 -- except in an MoE model whose first stage holds dense
    blocks: then the first stage of MoE blocks only is a candidate too.
    """
    if stage is not None:
        return [stage]
    candidates = {0, layout.pp - 1}
    if model is not None and model.n_experts and model.n_dense_layers:
        candidates.add(min(layout.pp - 1, model.n_dense_layers // (model.n_layers // layout.pp)))
    return sorted(candidates)


def memory_per_rank(workload: Workload, layout: Layout, stage: int | None = None) -> MemoryBreakdown:
    """Memory of one rank of ``stage``, or of the worst stage when ``stage`` is None."""
    check_layout(workload, layout)
    return max((_stage_memory(workload, layout, s) for s in _stages(layout, stage, workload.model)),
               key=lambda mb: mb.total)


def model_state_bytes(workload: Workload, layout: Layout, stage: int | None = None) -> int:
    """Parameters + gradients + optimizer state of one rank (worst stage when ``stage`` is None)."""
    check_layout(workload, layout)
    lay = layout
    return max(sum(_model_state(workload, lay.tp, lay.pp, lay.grad_ranks, lay.zero, s, lay.ep))
               for s in _stages(lay, stage, workload.model))


def activation_bytes(workload: Workload, layout: Layout, stage: int | None = None) -> int:
    """Peak activation bytes of one rank (worst stage when ``stage`` is None)."""
    check_layout(workload, layout)
    return max(_activation_bytes(workload, layout, s) for s in _stages(layout, stage, workload.model))


def micro_batch_activation_bytes(workload: Workload, layout: Layout, stage: int | None = None) -> int:
    """Bytes one micro-batch's forward saves for backward on one rank of ``stage`` (worst when None): its
    blocks, over all of the rank's chunks, plus :func:`_stage_extras`. This is what
    :class:`trainmesh.metrics.SavedActivations` measures of micro-batch 0, ``activation_bytes`` in
    ``metrics.jsonl``; :func:`activation_bytes` is the peak over the micro-batches in flight.
    """
    check_layout(workload, layout)
    return max(_micro_batch_activation_bytes(workload, layout, s) for s in _stages(layout, stage, workload.model))


# ----------------------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one step on the critical path; communication is assumed not to overlap compute."""

    compute: float
    dp_comm: float
    tp_comm: float
    pp_comm: float
    bubble: float
    cp_comm: float = 0.0
    ep_comm: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.dp_comm + self.tp_comm + self.pp_comm + self.bubble + self.cp_comm + self.ep_comm


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


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Idle fraction of the pipeline's time, in closed form, equal to what
    ``simulate(schedule_*(...)).bubble_fraction`` of :mod:`trainmesh.pipeline` gives for uniform stages,
    which can replace it once stage costs are measured.

    GPipe and 1F1B: (p-1)/(m+p-1) [NAR, 2.2.1]; interleaving divides the bubble by v [NAR, 2.2.2];
    ZB-H1 shrinks it to (p-1)(T_F + T_B - T_W), a third of 1F1B's when T_F = T_B = T_W [ZB, 3.1].
    """
    p, m = pp - 1, microbatches
    ideal = {"gpipe": m, "1f1b": m, "interleaved": virtual * m, "zb": 3 * m}[schedule]
    return p / (ideal + p)


def block_pass_flops_per_token(m: ModelShape, seq_len: int, recompute: str) -> float:
    """Executed FLOPs of one block per token over forward and backward.

    Backward costs twice the forward, so 3x; full recomputation reruns the forward (4x, the 96 of
    [NAR, app. FLOPs]); selective recomputation reruns only QK^T and AV [KOR, sec. 5].
    """
    fwd = block_flops_per_token(m.d_model, m.d_ff, seq_len, m.gated_mlp, m.qkv_width)
    return {"none": 3 * fwd, "selective": 3 * fwd + 4 * seq_len * m.d_model, "full": 4 * fwd}[recompute]


def step_flops(workload: Workload, recompute: str = "none") -> float:
    """FLOPs of one step.

    With ``recompute="none"`` these are the model FLOPs that MFU counts [PALM, app. B], the ones
    :func:`trainmesh.metrics.model_flops_per_token` gives the runtime's MFU; with the layout's recompute,
    the FLOPs the devices execute, which Megatron-LM reports [NAR, app. FLOPs].
    """
    m, s = workload.model, workload.seq_len
    model = model_flops_per_token(m.n_layers, m.d_model, m.d_ff, m.vocab_size, s, m.gated_mlp, m.qkv_width)
    moe_layers = m.n_layers - m.n_dense_layers if m.n_experts else 0
    model += 3 * moe_layers * (moe_block_flops_per_token(m, s) - block_flops_per_token(
        m.d_model, m.d_ff, s, m.gated_mlp, m.qkv_width))
    rerun = m.n_layers * (block_pass_flops_per_token(m, s, recompute) - block_pass_flops_per_token(m, s, "none"))
    if recompute == "full":
        rerun = model / 3 - head_flops_per_token(m.d_model, m.vocab_size)  # every block's forward, once more
    return workload.global_batch * s * (model + rerun)


def moe_block_flops_per_token(m: ModelShape, seq_len: int) -> int:
    """Forward FLOPs of one MoE block per token: a dense block whose MLP is ``top_k`` routed plus the shared
    experts (an MLP of their summed width), and the router's d x E matmul. Active parameters, not total."""
    width = (m.top_k + m.n_shared_experts) * m.expert_ff
    return block_flops_per_token(m.d_model, width, seq_len, m.gated_mlp, m.qkv_width) + 2 * m.d_model * m.n_experts


@dataclass(frozen=True)
class Gemm:
    """One matmul of a forward pass on one rank: its FLOPs and its (m, k, n) after the tp split."""

    flops: float
    dims: tuple[int, int, int]


def gemm_efficiency(cluster: Cluster, dims: tuple[int, ...]) -> float:
    """Fraction of peak a matmul of these dimensions reaches: ``gemm_efficiency`` times d / (d + d_half) per
    dimension. Small dimensions leave tiles idle and make the matmul memory-bound, so a saturating curve in
    each dimension is the simplest shape that does both (the "GEMM size" effect behind the rise of
    throughput with model size [NAR, 5.1])."""
    return cluster.gemm_efficiency * math.prod(d / (d + cluster.gemm_half_dim) for d in dims)


def block_gemms(workload: Workload, layout: Layout, moe: bool = False) -> dict[str, Gemm]:
    """The matmuls of one block's forward for one micro-batch on one tp rank [NAR, 2.3 and app. FLOPs]:
    column-parallel q/k/v and MLP-in split their outputs by t, row-parallel projections their inputs; the
    attention core multiplies head_dim-wide blocks (QK^T and AV, 4 b s_local s h / t FLOPs in all).

    An MoE block (``moe``) has the router's matmul and, in place of the MLP, its routed experts: with
    balanced routing a rank runs top_k copies of each of its tokens through its n_experts / ep local experts,
    so each expert's matmul takes ep x tokens x top_k / n_experts rows -- the reason ep makes expert
    matmuls efficient -- and the shared experts as one MLP over every token. None of these is split by tp
    (the experts are whole on every tp rank); the tokens are :func:`moe_tokens`, all of the micro-batch's
    on every tp rank without sequence parallelism, a 1/tp slice under it."""
    m, t = workload.model, layout.tp
    s_local = local_seq(workload, layout)
    tokens = s_local * micro_batch_size(workload, layout)
    h = m.d_model
    gemms = {
        "qkv": Gemm(2 * tokens * h * m.qkv_width / t, (tokens, h, m.qkv_width // t)),
        "proj": Gemm(2 * tokens * h * h / t, (tokens, h // t, h)),
        "attention": Gemm(4 * tokens * workload.seq_len * h / t, (s_local, h // m.n_heads, workload.seq_len)),
    }
    inputs = 2 if m.gated_mlp else 1
    if not moe:
        return gemms | _mlp_gemms("mlp", tokens, tokens, m.d_ff, inputs, h, t)
    routed = moe_tokens(workload, layout)
    rows = max(1, layout.ep * routed * m.top_k // m.n_experts)
    gemms["router"] = Gemm(2 * routed * h * m.n_experts, (routed, h, m.n_experts))
    gemms |= _mlp_gemms("experts", routed * m.top_k, rows, m.expert_ff, inputs, h, 1)
    if m.n_shared_experts:
        gemms |= _mlp_gemms("shared", routed, routed, m.n_shared_experts * m.expert_ff, inputs, h, 1)
    return gemms


def _mlp_gemms(name: str, tokens: int, rows: int, f: int, inputs: int, h: int, t: int) -> dict[str, Gemm]:
    """An MLP's input and output matmuls over ``tokens`` rows in all, ``rows`` per matmul."""
    return {f"{name}_in": Gemm(inputs * 2 * tokens * h * f / t, (rows, h, f // t)),
            f"{name}_out": Gemm(2 * tokens * f * h / t, (rows, f // t, h))}


def gemm_time(gemm: Gemm, workload: Workload, cluster: Cluster) -> float:
    return gemm.flops / (peak_flops(workload, cluster) * gemm_efficiency(cluster, gemm.dims))


def micro_compute_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Seconds of one micro-batch's forward and backward on a rank of ``stage``: each matmul of
    :func:`block_gemms` (and the head's on the last stage) at its own :func:`gemm_efficiency`, three times
    (backward costs twice the forward), four under full recomputation, the attention core once more under
    selective recomputation [KOR, sec. 5]."""
    m = workload.model
    passes = 4 if layout.recompute == "full" else 3

    def block(moe: bool) -> float:
        gemms = block_gemms(workload, layout, moe)
        rerun = gemm_time(gemms["attention"], workload, cluster) if layout.recompute == "selective" else 0.0
        return passes * sum(gemm_time(g, workload, cluster) for g in gemms.values()) + rerun

    dense, moe = stage_blocks(m, layout.pp, stage)
    total = dense * block(False) + (moe * block(True) if moe else 0.0)
    if stage == layout.pp - 1:
        tokens = local_seq(workload, layout) * micro_batch_size(workload, layout)
        head = Gemm(head_flops_per_token(m.d_model, m.vocab_size) * tokens / layout.tp,
                    (tokens, m.d_model, m.vocab_size // layout.tp))
        total += 3 * gemm_time(head, workload, cluster)
    return total


def _tp_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Each dense block all-reduces its sbh output twice forward and twice backward (twice more when the
    forward is recomputed) [NAR, 2.3]; sequence parallelism turns each into an all-gather plus a
    reduce-scatter of the same volume [KOR, 4.2.2]. An MoE block has only its attention's half: its router
    and experts are whole on every tp rank, so the MoE layer needs no tp collective of activations; under
    sequence parallelism each tp rank routes its own tokens through them, so their gradients are summed
    over tp after every micro-batch's backward (``tensor_parallel.sum_grad_over_tp``)."""
    t, model = layout.tp, workload.model
    if t == 1:
        return 0.0
    sbh = local_seq(workload, layout) * micro_batch_size(workload, layout) * model.d_model
    nbytes, link = sbh * workload.dtype_bytes.activation, cluster.link(t)
    if layout.sequence_parallel:
        one = 2 * ring_gather_time(nbytes, t, link)
    else:
        one = all_reduce_time(nbytes, t, link)
    count = 6 if layout.recompute == "full" else 4
    dense, moe = stage_blocks(model, layout.pp, stage)
    activations = count * one * (dense + moe / 2)
    if not (moe and layout.sequence_parallel):
        return activations
    replicated = moe * (expert_unit(model, layout.ep).numel + router_and_shared(model).numel)
    return activations + all_reduce_time(replicated * workload.dtype_bytes.grad, t, link)


def _pp_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """One activation forward and one gradient backward per chunk boundary, split by t [NAR, 4.1]."""
    if layout.pp == 1:
        return 0.0
    bw, alpha = cluster.link(layout.world)
    nbytes = local_seq(workload, layout) * micro_batch_size(workload, layout) * workload.model.d_model // layout.tp
    return 2 * layout.virtual * (alpha + nbytes * workload.dtype_bytes.activation / bw)


def cp_bytes_per_micro(workload: Workload, layout: Layout) -> dict[str, float]:
    """Bytes one rank sends over cp for one micro-batch's forward and backward, per op, as
    :class:`trainmesh.comm.Comm` counts them (``cp/ring_kv`` ...).

    Ring: a layer's local K/V block (2 b (s/cp) kv_heads d_head elements) is sent cp-1 times forward, and
    in backward cp-1 times again plus its gradient cp times (fp32 or wider: the accumulation dtype), i.e.
    (cp-1)/cp of the layer's whole K/V per direction [Liu et al., 2023, Ring Attention]. a2a: q, k, v and
    the output go through one all-to-all each way, (cp-1)/cp of each tensor [Jacobs et al., 2023, Ulysses].
    """
    m, lay, e = workload.model, layout, workload.dtype_bytes.activation
    cp, layers = lay.cp, m.n_layers // lay.pp
    if cp == 1:
        return {}
    tokens = local_seq(workload, lay) * micro_batch_size(workload, lay)
    head_dim = m.d_model // m.n_heads
    kv = 2 * tokens * m.kv_heads * head_dim // lay.tp
    if lay.cp_impl == "ring":
        grad = max(e, DTYPE_BYTES["fp32"])
        return {"ring_kv": layers * (cp - 1) * kv * e,
                "ring_kv_grad": layers * ((cp - 1) * kv * e + cp * kv * grad)}
    q_and_out = 2 * tokens * m.d_model // lay.tp
    return {"all_to_all": layers * 2 * (cp - 1) / cp * (q_and_out + kv) * e}


def _cp_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """Exposed cp communication of one micro-batch. The ring's messages overlap the attention of the block
    at hand, so only what exceeds the attention's compute shows; the all-to-alls sit on the critical path."""
    sent = sum(cp_bytes_per_micro(workload, layout).values())
    if not sent:
        return 0.0
    bw, alpha = cluster.link(layout.tp * layout.cp)
    layers = workload.model.n_layers // layout.pp
    if layout.cp_impl == "a2a":
        return 8 * layers * alpha + sent / bw
    attention = block_gemms(workload, layout)["attention"]
    hidden = layers * 3 * gemm_time(attention, workload, cluster) / 2  # causal: half the score matrix
    messages = layers * (3 * layout.cp - 2)
    return max(0.0, messages * alpha + sent / bw - hidden)


def all_to_all_bytes_per_micro(workload: Workload, layout: Layout, stage: int) -> float:
    """Bytes one rank of ``stage`` sends over ep for one micro-batch: every MoE layer dispatches and
    combines top_k copies of each token (tokens x top_k x d x activation bytes per direction, of which
    (ep-1)/ep leave the rank) twice forward and twice backward, twice more when the forward is recomputed.
    Each tp rank dispatches the copies of its own :func:`moe_tokens` over its own ep group: all of its
    micro-batch's tokens without sequence parallelism (every tp rank sends the same copies), a 1/tp
    slice under it."""
    m, lay = workload.model, layout
    moe = stage_blocks(m, lay.pp, stage)[1]
    if lay.ep == 1 or not moe:
        return 0.0
    one = moe_tokens(workload, lay) * m.top_k * m.d_model * workload.dtype_bytes.activation * (lay.ep - 1) / lay.ep
    return moe * (6 if lay.recompute == "full" else 4) * one


def _ep_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """The all-to-alls of :func:`all_to_all_bytes_per_micro` on the critical path, each ep - 1 messages.
    The ep group is ep ranks tp apart inside the data-parallel group, so it spans tp x ep ranks."""
    sent = all_to_all_bytes_per_micro(workload, layout, stage)
    if not sent:
        return 0.0
    bw, alpha = cluster.link(layout.tp * layout.ep)
    calls = stage_blocks(workload.model, layout.pp, stage)[1] * (6 if layout.recompute == "full" else 4)
    return calls * (layout.ep - 1) * alpha + sent / bw


def dp_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Data-parallel traffic of one step [ZeRO, sec. 7].

    ZeRO-0 all-reduces gradients once (2 Psi); ZeRO-1 reduce-scatters them and all-gathers the updated
    parameters (the same 2 Psi); ZeRO-2 keeps no full gradient, so it reduce-scatters after every
    micro-batch; ZeRO-3 also gathers each unit for every micro-batch's forward and backward (3 Psi per
    micro-batch), and under zero bubble for its input- and weight-gradient passes apart (4 Psi; see
    :class:`trainmesh.parallel.zero.ZeroStage3`), each unit in a collective of its own (a latency per unit). None of it is assumed hidden behind compute: that fits
    Megatron-LM's ZeRO-3 measurements at 768 and 1536 GPUs better than perfect overlap does [NAR, Table 2].
    """
    lay, model = layout, workload.model
    experts = stage_expert_units(model, lay.pp, lay.ep, stage)
    dense = _dp_group_time(stage_units(model, lay.tp, lay.pp, stage), lay.grad_ranks, workload, lay, cluster)
    return dense + _dp_group_time(experts, lay.grad_ranks // lay.ep, workload, lay, cluster)


def _dp_group_time(units: tuple[tuple[Unit, int], ...], n: int, workload: Workload, layout: Layout,
                   cluster: Cluster) -> float:
    """:func:`dp_time` of ``units`` reduced over ``n`` ranks (the expert-data-parallel group for experts)."""
    m, b = layout.microbatches, workload.dtype_bytes
    if n == 1 or not units:
        return 0.0
    psi = sum((-(-u.numel // n) * n if layout.zero else u.numel) * k for u, k in units)
    link = cluster.link(layout.world // layout.pp)
    if layout.zero == 0:
        return all_reduce_time(b.grad * psi, n, link)
    gather, scatter = ring_gather_time(b.param * psi, n, link), ring_gather_time(b.grad * psi, n, link)
    if layout.zero == 3:  # one collective per unit: each pays its own latency
        extra = (sum(k for _, k in units) - 1) * (n - 1) * link[1]
        gather, scatter = gather + extra, scatter + extra
    passes = 3 if layout.schedule == "zb" else 2
    return {1: scatter + gather, 2: m * scatter + gather, 3: m * (passes * gather + scatter)}[layout.zero]


def peak_flops(workload: Workload, cluster: Cluster) -> float:
    """fp64 counts at the fp32 peak: A100's and H100's fp64 tensor cores match their fp32 rate."""
    return cluster.peak_flops_fp32 if workload.precision in FULL_PRECISIONS else cluster.peak_flops


def step_time(workload: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    """Predicted step time: the slowest stage's micro-batches, the bubble around them, then dp traffic.

    Compute is each matmul's FLOPs at its own efficiency (:func:`micro_compute_time`); tp and pp traffic sit on
    the critical path; the bubble stretches the per-micro-batch time by f/(1-f) with f from
    :func:`bubble_fraction`. Where ranks share cores (``ranks_per_core`` r > 1: more CPU processes than
    cores), computing takes r times as long, and a rank's bubble is time the others compute in, so only
    what the bubble adds beyond that shows.
    """
    check_layout(workload, layout)
    stages = _stages(layout, None, workload.model)
    m = layout.microbatches
    compute = m * max(micro_compute_time(workload, layout, cluster, s) for s in stages)
    tp = m * max(_tp_time_per_micro(workload, layout, cluster, s) for s in stages)
    pp = m * _pp_time_per_micro(workload, layout, cluster)
    ep = m * max(_ep_time_per_micro(workload, layout, cluster, s) for s in stages)
    f = bubble_fraction(layout.schedule, layout.pp, m, layout.virtual)
    bubble = (compute + tp + pp + ep) * f / (1 - f)
    if cluster.ranks_per_core > 1:  # cores shared: each rank's compute waits its turn, bubbles are filled
        shared = compute * cluster.ranks_per_core
        compute, bubble = shared, max(0.0, compute + bubble - shared)
    dp = max(dp_time(workload, layout, cluster, s) for s in stages)
    cp = m * _cp_time_per_micro(workload, layout, cluster)
    return TimeBreakdown(compute, dp, tp, pp, bubble, cp, ep)


# ----------------------------------------------------------------------------------------------------------
# Search
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A layout with its worst-stage memory and predicted step.

    ``mfu`` counts model FLOPs only [PALM, app. B]; ``tflops_per_device`` counts executed FLOPs,
    recomputation included, as Megatron-LM reports throughput [NAR, 5.1].
    """

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    mfu: float
    tflops_per_device: float
    tokens_per_s: float


def estimate(
    workload: Workload, layout: Layout, cluster: Cluster, memory: MemoryBreakdown | None = None
) -> Estimate:
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
    for v in (2, 4):
        if n_layers % (pp * v) == 0 and microbatches % pp == 0:
            yield "interleaved", v


def cp_degrees(workload: Workload, cluster: Cluster) -> list[int]:
    """The cp sizes worth searching: 1, and from :data:`LONG_SEQUENCE` tokens on, every power of two that
    splits the sequence into 2·cp chunks of at least :data:`MIN_CP_CHUNK` tokens (shorter chunks leave the
    ring's messages nothing to hide behind)."""
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
        for tp in _divisors(cluster.gpus_per_node):
            if cluster.gpus % (tp * cp):
                continue
            for pp in _divisors(cluster.gpus // (tp * cp)):
                dp = cluster.gpus // (tp * cp * pp)
                if m.n_layers % pp == 0 and workload.global_batch % dp == 0 and _splits(m, tp, pp):
                    yield dp, cp, tp, pp


def _splits(model: ModelShape, tp: int, pp: int) -> bool:
    """Whether tp x pp can split ``model`` by the layout's rules (whole heads per tp rank, untied embeddings)."""
    try:
        validate(Settings(tp=tp, pp=pp), model)
    except LayoutError:
        return False
    return True


def ep_degrees(model: ModelShape, grad_ranks: int) -> list[int]:
    """The ep sizes an MoE model can take in a dp x cp group of ``grad_ranks``: those dividing both the
    group and the expert count; [1] for a dense model."""
    return [e for e in _divisors(grad_ranks) if model.n_experts % e == 0] if model.n_experts else [1]


def enumerate_layouts(workload: Workload, cluster: Cluster) -> Iterator[Layout]:
    """Every valid layout on the cluster: micro-batch sizes from MICRO_BATCH_SIZES, v in {2, 4}, cp from
    :func:`cp_degrees` (ring attention), ep from :func:`ep_degrees`; a combination the layout's rules refuse
    (the zero-bubble schedule with cp) is skipped."""
    for dp, cp, tp, pp in _meshes(workload, cluster):
        per_replica = workload.global_batch // dp
        sps = (False, True) if tp > 1 and (workload.seq_len // cp) % tp == 0 else (False,)
        for micro in (per_replica // b for b in MICRO_BATCH_SIZES if per_replica % b == 0):
            options = itertools.product(_schedules(pp, workload.model.n_layers, micro), ZERO_STAGES,
                                        RECOMPUTE, sps, ep_degrees(workload.model, dp * cp))
            for (schedule, v), zero, recompute, sp, ep in options:
                candidate = _candidate(workload, dp, tp, pp, zero, micro, schedule, v, recompute, sp, cp=cp, ep=ep)
                if candidate is not None:
                    yield candidate


def _candidate(workload: Workload, *args: object, **kwargs: object) -> Layout | None:
    """``Layout(*args, **kwargs)`` if it keeps the layout's rules for ``workload``, else None."""
    try:
        layout = Layout(*args, **kwargs)
        check_layout(workload, layout)
    except LayoutError:
        return None
    return layout


# Predicted step times this close to the fastest (relative) count as equal: the model is no more exact.
TIE_TOLERANCE = 0.01


def search(workload: Workload, cluster: Cluster) -> list[Estimate]:
    """All layouts that fit in ``cluster.usable_bytes`` per rank, fastest predicted step first, except that
    the layouts within :data:`TIE_TOLERANCE` of the fastest come first in order of memory per rank: among
    equal times the one with the most headroom is chosen (a layout that barely fits is the first to fail
    on fragmentation or a longer sequence)."""
    found = []
    for layout in enumerate_layouts(workload, cluster):
        memory = memory_per_rank(workload, layout)
        if memory.total <= cluster.usable_bytes:
            found.append(estimate(workload, layout, cluster, memory))
    found.sort(key=lambda e: (e.time.total, e.memory.total, e.layout.microbatches))
    if not found:
        return found
    tied = sum(e.time.total <= found[0].time.total * (1 + TIE_TOLERANCE) for e in found)
    return sorted(found[:tied], key=lambda e: (e.memory.total, e.time.total)) + found[tied:]


def best_layout(workload: Workload, cluster: Cluster) -> Layout:
    """The fastest layout that fits; what ``trainmesh train --plan auto`` runs."""
    found = search(workload, cluster)
    if not found:
        raise ValueError(
            f"no layout of {workload.model.n_params():,} parameters fits in {cluster.usable_bytes / GIB:.1f} "
            f"usable GiB on {cluster.gpus} devices; add devices, lower global_batch or seq_len, or use a "
            f"smaller model"
        )
    return found[0].layout


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------


def _scaled(value: float, steps: tuple[str, ...], base: int) -> str:
    """``value`` with the largest unit of ``steps`` (each ``base`` times the previous) that keeps it >= 1."""
    exponent = 0
    while exponent < len(steps) - 1 and abs(value) >= base ** (exponent + 1):
        exponent += 1
    return f"{value / base**exponent:.1f}{steps[exponent]}"


def _row(workload: Workload, e: Estimate) -> list[str]:
    lay = e.layout
    sched = f"{lay.schedule}x{lay.virtual}" if lay.virtual > 1 else lay.schedule
    layout = [lay.dp, lay.cp, lay.tp, lay.pp, *([lay.ep] if workload.model.n_experts else []), lay.zero,
              micro_batch_size(workload, lay), lay.microbatches, sched, lay.recompute,
              "y" if lay.sequence_parallel else "n"]
    measures = [_scaled(e.memory.total, (" B", " KiB", " MiB", " GiB"), 1024), f"{e.time.total:.4g}",
                f"{e.mfu:.1%}", f"{e.tokens_per_s:,.0f}"]
    return [str(c) for c in layout] + measures


def format_table(workload: Workload, cluster: Cluster, estimates: list[Estimate], top: int = 20,
                 model: str | None = None) -> str:
    """The ``top`` fastest layouts as a text table, then the chosen one as the command that runs it
    (:func:`train_command`; ``model`` is the preset's name, if the workload is one)."""
    head = ["dp", "cp", "tp", "pp", *(["ep"] if workload.model.n_experts else []), "zero", "mbs", "m", "schedule",
            "recompute", "sp", "mem/rank", "step s", "MFU", "tokens/s"]
    rows = [head] + [_row(workload, e) for e in estimates[:top]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    m = workload.model
    params = _scaled(m.n_params(), ("", "K", "M", "B", "T"), 1000)
    if m.n_experts:
        params += f" ({_scaled(active_params(m), ('', 'K', 'M', 'B', 'T'), 1000)} active)"
    title = (f"{params} params, batch {workload.global_batch} x {workload.seq_len}, {workload.precision}, "
             f"{cluster.gpus} devices of {cluster.mem_bytes / GIB:.0f} GiB: {len(estimates)} layouts fit")
    chosen = f"chosen: {train_command(workload, estimates[0].layout, cluster, model)}" if estimates \
        else "chosen: none fits"
    whys = [why for why in (explain_cp(workload, estimates), explain_ep(workload, estimates)) if why]
    return "\n".join([title, *("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows), chosen, *whys])


def explain_cp(workload: Workload, estimates: list[Estimate]) -> str:
    """Why the chosen layout splits sequences over cp (empty when it does not): the activations it saves
    and the fastest layout without it."""
    if not estimates or estimates[0].layout.cp == 1:
        return ""
    chosen = estimates[0]
    cp = chosen.layout.cp
    gib = (" B", " KiB", " MiB", " GiB", " TiB")
    alone = activation_bytes(workload, dataclasses.replace(chosen.layout, cp=1))
    text = (f"why cp={cp}: each rank holds {workload.seq_len // cp:,} of a sequence's {workload.seq_len:,} tokens, "
            f"so its activations are {_scaled(chosen.memory.activations, gib, 1024)} instead of "
            f"{_scaled(alone, gib, 1024)} with the same layout at cp=1; ")
    return _beside_fastest_without("cp", estimates, text, "recompute",
                                   f"{chosen.time.cp_comm:.3g} s of it cp traffic the attention does not hide")


def explain_ep(workload: Workload, estimates: list[Estimate]) -> str:
    """Why the chosen layout splits the experts over ep (empty when it does not): the expert state it
    saves, the larger expert matmuls, and the fastest layout without it."""
    if not estimates or estimates[0].layout.ep == 1:
        return ""
    chosen, m = estimates[0], workload.model
    lay, gib = chosen.layout, (" B", " KiB", " MiB", " GiB", " TiB")
    alone = dataclasses.replace(lay, ep=1)
    tokens = moe_tokens(workload, lay) * m.top_k
    text = (f"why ep={lay.ep}: each rank holds {m.n_experts // lay.ep} of the {m.n_experts} routed experts of each "
            f"MoE layer, so its model state is {_scaled(chosen.memory.model_state, gib, 1024)} instead of "
            f"{_scaled(memory_per_rank(workload, alone).model_state, gib, 1024)} with the same layout at ep=1, "
            f"and each expert's matmuls take {lay.ep * tokens // m.n_experts:,} token rows per micro-batch "
            f"instead of {max(1, tokens // m.n_experts):,}; ")
    return _beside_fastest_without("ep", estimates, text, "zero", f"{chosen.time.ep_comm:.3g} s of it all-to-all")


def _beside_fastest_without(axis: str, estimates: list[Estimate], text: str, knob: str, traffic: str) -> str:
    """``text`` and the fastest layout with ``axis`` at 1 beside the chosen one, whose time includes
    ``traffic`` (the exposed communication of that axis)."""
    without = next((e for e in estimates if getattr(e.layout, axis) == 1), None)
    if without is None:
        return text + f"no layout without {axis} fits"
    lay = without.layout
    return text + (f"the fastest layout without {axis} (dp={lay.dp} tp={lay.tp} pp={lay.pp} "
                   f"{knob}={getattr(lay, knob)}) is predicted {without.time.total:.3g} s/step against {estimates[0].time.total:.3g} s ({traffic})")


def to_json(workload: Workload, cluster: Cluster, estimates: list[Estimate], top: int = 20) -> str:
    """The same as :func:`format_table` as JSON, totals included."""
    def row(e: Estimate) -> dict[str, object]:
        return {
            "layout": dataclasses.asdict(e.layout),
            "memory": {**dataclasses.asdict(e.memory), "model_state": e.memory.model_state,
                       "total": e.memory.total},
            "time": {**dataclasses.asdict(e.time), "total": e.time.total},
            "mfu": e.mfu,
            "tflops_per_device": e.tflops_per_device,
            "tokens_per_s": e.tokens_per_s,
        }
    return json.dumps({
        "workload": dataclasses.asdict(workload),
        "cluster": dataclasses.asdict(cluster),
        "fitting_layouts": len(estimates),
        "chosen": row(estimates[0]) if estimates else None,
        "layouts": [row(e) for e in estimates[:top]],
    }, indent=2)


# ----------------------------------------------------------------------------------------------------------
# The runtime's configuration: what ``trainmesh train`` runs, as the planner sees it
# ----------------------------------------------------------------------------------------------------------


LAYOUT_FIELDS = {"dp": "dp", "tp": "tp", "pp": "pp", "zero": "zero", "microbatches": "microbatches",
                 "schedule": "schedule", "virtual": "virtual_stages", "recompute": "recompute",
                 "sequence_parallel": "sequence_parallel", "cp": "cp", "cp_impl": "cp_impl",
                 "ep": "ep"}  # Layout -> Config


def workload_of(cfg: Config) -> Workload:
    """The workload a :class:`~trainmesh.app.config.Config` trains: its model, global batch and dtypes."""
    model = cfg.model_config
    return Workload(spec_of(cfg.model).shape(model), cfg.global_batch, model.seq_len, cfg.precision, cfg.reduce_dtype)


def layout_of(cfg: Config) -> Layout:
    """The layout a config runs. Without a pipeline the schedule means nothing and is taken as 1F1B."""
    fields = {name: getattr(cfg, field) for name, field in LAYOUT_FIELDS.items()}
    if cfg.pp == 1:
        fields.update(schedule="1f1b", virtual=1)
    return Layout(**fields, bucket_bytes=max(1, int(cfg.bucket_mb * 2**20)))


def with_layout(cfg: Config, layout: Layout) -> Config:
    """``cfg`` running ``layout`` instead of its own (on ``layout.world`` local ranks)."""
    fields = {field: getattr(layout, name) for name, field in LAYOUT_FIELDS.items()}
    return dataclasses.replace(cfg, nproc=layout.world, bucket_mb=layout.bucket_bytes / 2**20, **fields)


def train_flags(workload: Workload, layout: Layout) -> list[str]:
    """``trainmesh train`` flags that run ``layout`` on ``workload``'s batch and dtypes: every layout field
    (the pipeline's schedule only with a pipeline, cp's implementation only with cp, the bucket size only
    when it is not the default), then what differs from :class:`~trainmesh.app.config.Config`'s defaults."""
    cfg = with_layout(Config(global_batch=workload.global_batch, precision=workload.precision,
                             reduce_dtype=workload.reduce_dtype), layout)
    skip = {"schedule", "virtual_stages"} if layout.pp == 1 else set()
    skip |= {"cp_impl"} if layout.cp == 1 else set()
    skip |= {"ep"} if not workload.model.n_experts else set()
    skip |= {"sequence_parallel"} if not layout.sequence_parallel else set()
    flags = [f for field in LAYOUT_FIELDS.values() if field not in skip for f in _flag_of(cfg, field)]
    defaults = Config()
    extra = [f for field in ("bucket_mb", "precision", "reduce_dtype")
             if getattr(cfg, field) != getattr(defaults, field) for f in _flag_of(cfg, field)]
    return [*flags, "--global-batch", str(workload.global_batch), *extra]


def _flag_of(cfg: Config, field: str) -> list[str]:
    value, name = getattr(cfg, field), "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return [name if value else "--no-" + name[2:]]
    return [name, f"{value:g}" if isinstance(value, float) else str(value)]


def train_command(workload: Workload, layout: Layout, cluster: Cluster, model: str | None = None) -> str:
    """The command line that runs ``layout``: ``trainmesh train --nproc N ...`` on one node, the same flags
    under ``torchrun`` on each node of several. ``--model`` (and ``--seq-len`` when it is not the preset's)
    when the workload is preset ``model``; :func:`train_flags` for the rest. A planning-only shape (a model
    ``train`` does not build, such as DeepSeek-V3's latent attention) gets the layout's flags and a comment
    saying so, rather than a ``--model`` that ``train`` would refuse."""
    buildable = model is not None and model in PRESET_NAMES
    named = ["--model", model] if buildable else []
    if buildable and workload.seq_len != model_shape(model).seq_len:
        named += ["--seq-len", str(workload.seq_len)]
    flags = train_flags(workload, layout)
    if layout.world <= cluster.gpus_per_node:
        line = ["trainmesh", "train", *named, "--nproc", str(layout.world), *flags]
    else:
        nodes = layout.world // cluster.gpus_per_node
        line = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(cluster.gpus_per_node),
                "-m", "trainmesh", "train", *named, *flags]
    if model is not None and not buildable:
        line += ["  #", f"{model} is a planning shape trainmesh does not build: these flags lay out your own model of it"]
    return " ".join(line)


def layout_flags(cfg: Config) -> list[str]:
    """Command-line flags that pin ``cfg``'s layout and turn ``--plan`` off, for the ranks a planned run spawns."""
    return [*(f for field in LAYOUT_FIELDS.values() for f in _flag_of(cfg, field)), "--plan", ""]


# torch.cuda.get_device_name() substrings -> cluster presets; an unknown GPU is planned as an A100 with its
# own memory size.
GPU_NAMES = {"H200": "h200-141gb", "H100": "h100-80gb", "A100": "a100-80gb"}


def local_cluster(world: int, gpu_name: str | None = None, gpu_mem_bytes: int | None = None) -> Cluster:
    """The devices ``world`` local ranks run on: one GPU each when ``gpu_name`` is given, else CPU
    processes sharing this host's physical memory and cores (``ranks_per_core``; the ``cpu`` preset's
    figures otherwise)."""
    if gpu_name is None:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cpu = make_cluster("cpu", world, mem_gb=host / world / GIB)
        return dataclasses.replace(cpu, ranks_per_core=max(1.0, world / (os.cpu_count() or 1)))
    preset = next((p for key, p in GPU_NAMES.items() if key in gpu_name), "a100-80gb")
    if preset == "a100-80gb" and gpu_mem_bytes is not None and gpu_mem_bytes < 60 * GIB:
        preset = "a100-40gb" if "A100" in gpu_name else preset
    mem_gb = None if gpu_mem_bytes is None else gpu_mem_bytes / GIB
    return make_cluster(preset, world, mem_gb=mem_gb)


def runnable_layouts(cfg: Config, world: int, cluster: Cluster) -> Iterator[Estimate]:
    """What :func:`search` finds for ``cfg``'s workload on ``cluster``, fastest first, keeping only the
    layouts the layout's rules (:func:`trainmesh.layout.validate`) accept with ``cfg``'s other settings on
    ``world`` ranks: pipeline flags without a pipeline, a schedule that cannot run with ``--compile``."""
    work = workload_of(cfg)
    for found in search(work, cluster):
        try:
            validate(with_layout(cfg, found.layout).layout, work.model, world)
        except LayoutError:
            continue
        yield found


def auto_config(cfg: Config, world: int, cluster: Cluster) -> tuple[Config, Estimate]:
    """``cfg`` with the fastest predicted layout that fits ``cluster`` (``world`` ranks) and that the
    runtime accepts, and that layout's estimate. ``cfg.plan`` is kept: it records how the layout was chosen."""
    best = next(runnable_layouts(cfg, world, cluster), None)
    if best is None:
        work = workload_of(cfg)
        raise ValueError(
            f"--plan auto: no layout of {cfg.model} ({work.model.n_params():,} parameters) at global batch "
            f"{cfg.global_batch} fits in {cluster.usable_bytes / GIB:.1f} usable GiB on each of {world} "
            f"rank(s) and runs with these settings; add ranks, lower --global-batch, or set the layout by hand"
        )
    return with_layout(cfg, best.layout), best


def this_machine(world: int, use_cuda: bool) -> Cluster:
    """:func:`local_cluster` of this machine: its first GPU's name and memory when ``use_cuda``."""
    if not use_cuda:
        return local_cluster(world)
    import torch

    return local_cluster(world, torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)


def state_fit_problem(cfg: Config, world: int, cuda_devices: int = 0) -> str | None:
    """Why ``cfg``'s layout cannot hold even its model state (weights, gradients, optimizer) in this
    machine's memory per rank, or None. Checked before ranks are spawned, so a full-sized preset on a
    small machine is refused in one line instead of each rank being killed for memory."""
    cluster = this_machine(world, cuda_devices > 0 and cfg.device != "cpu")
    state = model_state_bytes(workload_of(cfg), layout_of(cfg))
    if state <= cluster.mem_bytes:
        return None
    return (f"--model {cfg.model} at this layout needs {state / GIB:.1f} GiB of model state on each rank, more "
            f"than the {cluster.mem_bytes / GIB:.1f} GiB each of the {world} rank(s) has here; shard it over "
            f"more ranks (--zero 3, --tp, --pp), pick a smaller preset, or see trainmesh plan --model {cfg.model}")


def plan_config(cfg: Config, world: int, cuda_devices: int = 0) -> tuple[Config, str]:
    """``trainmesh train --plan auto`` on this machine: the planned config and the line to print."""
    cluster = this_machine(world, cuda_devices > 0 and cfg.device != "cpu")
    planned, chosen = auto_config(cfg, world, cluster)
    return planned, describe_choice(chosen, cluster)


def describe_choice(chosen: Estimate, cluster: Cluster) -> str:
    """The one line ``--plan auto`` prints: the layout it runs and why."""
    lay = chosen.layout
    sched = f" schedule={lay.schedule}" + (f" virtual={lay.virtual}" if lay.virtual > 1 else "") if lay.pp > 1 else ""
    mem = _scaled(chosen.memory.total, (" B", " KiB", " MiB", " GiB"), 1024)
    cp = f" cp={lay.cp} cp_impl={lay.cp_impl}" if lay.cp > 1 else ""
    ep = f" ep={lay.ep}" if lay.ep > 1 else ""
    return (f"trainmesh: --plan auto: dp={lay.dp} tp={lay.tp} pp={lay.pp} zero={lay.zero} "
            f"microbatches={lay.microbatches}{sched} recompute={lay.recompute} "
            f"sequence_parallel={lay.sequence_parallel}{cp}{ep} (predicted {chosen.time.total * 1e3:.3g} ms/step, "
            f"{mem}/rank of {cluster.usable_bytes / GIB:.1f} GiB usable)")


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


SHAPE_FLAGS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "ffn": "d_ff",
               "vocab": "vocab_size", "seq": "seq_len"}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``trainmesh plan``: a model preset or explicit shape (``--ffn`` defaults to 4 * hidden),
    the batch, and a cluster preset whose figures explicit flags override.

    ``cli.py`` wires the command as ``add_plan_arguments(subparsers.add_parser("plan"))`` and then
    ``print(plan_from_args(args))``; ``trainmesh train --plan auto`` calls :func:`plan_config`.
    """
    parser.add_argument("--model", help=f"model preset: {', '.join(MODEL_PRESETS)}")
    for flag in SHAPE_FLAGS:
        parser.add_argument(f"--{flag}", type=int, help="explicit shape or override of --model's")
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: one per device)")
    parser.add_argument("--precision", choices=list(DTYPE_BYTES), default=Config.precision,
                        help=f"as trainmesh train's (default: {Config.precision})")
    parser.add_argument("--reduce-dtype", choices=["auto", *DTYPE_BYTES], default=Config.reduce_dtype,
                        help="dtype gradients are held and reduced in, as trainmesh train's (default: "
                             f"{Config.reduce_dtype}: fp32, or fp64 under --precision fp64)")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu", choices=list(CLUSTER_PRESETS), default="a100-80gb")
    parser.add_argument("--mem-gb", type=float, help="memory per device in GiB (overrides --gpu)")
    parser.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s per device (overrides --gpu)")
    parser.add_argument("--intra-gbps", type=float, help="intra-node GB/s per device (overrides --gpu)")
    parser.add_argument("--inter-gbps", type=float, help="inter-node GB/s per device (overrides --gpu)")
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def workload_from(
    model: str | None, global_batch: int, precision: str = Config.precision, reduce_dtype: str = Config.reduce_dtype,
    **shape: int | None,
) -> Workload:
    """A workload from a preset, from an explicit GPT-2-layout shape, or from a preset with fields replaced.

    ``shape`` takes :class:`ModelShape` field names; None values are ignored; d_ff defaults to 4 * d_model.
    """
    given = {k: v for k, v in shape.items() if v is not None}
    if model is not None:
        resolved = dataclasses.replace(model_shape(model), **given)
    else:
        flags = {field: flag for flag, field in SHAPE_FLAGS.items() if field != "d_ff"}
        missing = [f"--{flag}" for field, flag in flags.items() if field not in given]
        if missing:
            raise ValueError(f"give --model or a whole shape; missing {' '.join(missing)}")
        resolved = ModelShape(**{"d_ff": 4 * given["d_model"], **given})
    return Workload(resolved, global_batch, resolved.seq_len, precision, reduce_dtype)


def plan_from_args(args: argparse.Namespace) -> str:
    """Run ``trainmesh plan``: parse with :func:`add_plan_arguments`, print what this returns."""
    shape = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()}
    workload = workload_from(args.model, args.global_batch or args.gpus, args.precision, args.reduce_dtype, **shape)
    cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node, mem_gb=args.mem_gb,
                           peak_tflops=args.peak_tflops, intra_gbps=args.intra_gbps,
                           inter_gbps=args.inter_gbps)
    estimates = search(workload, cluster)
    if args.json:
        return to_json(workload, cluster, estimates, args.top)
    reshaped = any(v is not None for k, v in shape.items() if k != "seq_len")
    return format_table(workload, cluster, estimates, args.top, None if reshaped else args.model)
