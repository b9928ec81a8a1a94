"""Time of one step: each matmul at its own efficiency, every axis's collectives on the critical path, and
the pipeline's bubble. Communication does not overlap compute except where noted (ring messages, ZeRO-3
prefetch, the expert all-to-all under ``Pricing.a2a_overlap``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from trainmesh.tracking.metrics import head_flops_per_token
from trainmesh.models.spec import ModelShape
from trainmesh.distributed.hardware import Cluster
from trainmesh.plan.dp_traffic import all_reduce_time, dp_traffic, ring_gather_time
from trainmesh.plan.flops import (attention_forward_flops, attention_weights, block_forward_flops, core_width,
                                  is_moe_layer)
from trainmesh.plan.kernels import (ATTENTION_PEAK, BACKWARD_FLOPS, attention_rates, busiest_expert_rank,
                                    deepep_shares, grouped_rows_share)
from trainmesh.plan.memory import candidate_stages, expert_unit, router_and_shared, stage_blocks
from trainmesh.plan.stages import stage_kinds
from trainmesh.layout import Layout
from trainmesh.plan.workload import Workload, check_layout, local_seq, micro_batch_size, moe_tokens, stage_split
from trainmesh.training.state_bytes import DTYPE_BYTES, STORED_AS


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one step on the critical path: each communication part is what compute does not hide."""

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


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Idle fraction of the pipeline in closed form (as ``simulate`` gives for uniform stages): (p-1)/(m+p-1) for
    GPipe and 1F1B [NAR, 2.2.1], divided by v interleaved [NAR, 2.2.2], a third of 1F1B's for ZB-H1 [ZB, 3.1]."""
    p, m = pp - 1, microbatches
    ideal = {"gpipe": m, "1f1b": m, "interleaved": virtual * m, "zb": 3 * m}[schedule]
    return p / (ideal + p)


def block_pass_flops_per_token(m: ModelShape, seq_len: int, recompute: str) -> float:
    """Executed FLOPs of one block per token, forward and backward: 3x the forward, 4x under full
    recomputation [NAR, app. FLOPs]; selective recomputation reruns only QK^T and AV [KOR, sec. 5]."""
    fwd = block_forward_flops(m, seq_len)
    core = attention_forward_flops(m, seq_len) - 2 * attention_weights(m)
    return {"none": 3 * fwd, "selective": 3 * fwd + core, "full": 4 * fwd}[recompute]


def step_flops(workload: Workload, recompute: str = "none") -> float:
    """FLOPs of one step: with ``recompute="none"`` the model FLOPs MFU counts [PALM, app. B]; with the
    layout's recompute, the FLOPs the devices execute [NAR, app. FLOPs]."""
    m, s = workload.model, workload.seq_len
    moe_layers = m.n_layers - m.n_dense_layers if m.n_experts else 0
    blocks = (m.n_layers - moe_layers) * block_forward_flops(m, s) + moe_layers * block_forward_flops(m, s, moe=True)
    model = 3 * (blocks + head_flops_per_token(m.d_model, m.vocab_size))
    rerun = m.n_layers * (block_pass_flops_per_token(m, s, recompute) - block_pass_flops_per_token(m, s, "none"))
    if recompute == "full":
        rerun = model / 3 - head_flops_per_token(m.d_model, m.vocab_size)  # every block's forward, once more
    return workload.global_batch * s * (model + rerun)


def model_flops_per_token(m: ModelShape) -> float:
    """Training FLOPs per token that MFU counts for ``m`` at its own sequence length (:func:`step_flops` of one
    sequence): what ``train`` reports and the planner predicts, MoE layers at their active experts, windows at
    their keys."""
    return step_flops(Workload(m, 1, m.seq_len)) / m.seq_len


@dataclass(frozen=True)
class Gemm:
    """One forward matmul on one rank: FLOPs, (m, k, n) after the tp split, and whether fp8 runs it in float8 (attention
    core, router, head and grouped experts stay bf16 [DSV3, 3.3.1] unless ``Pricing.fp8_experts``)."""

    flops: float
    dims: tuple[int, int, int]
    linear: bool = True


def gemm_efficiency(cluster: Cluster, dims: tuple[int, ...]) -> float:
    """Fraction of peak a matmul reaches: ``gemm_efficiency`` times d / (d + d_half) per dimension, a saturating
    curve for small dimensions leaving tiles idle [NAR, 5.1]."""
    return cluster.gemm_efficiency * math.prod(d / (d + cluster.gemm_half_dim) for d in dims)


def block_gemms(workload: Workload, layout: Layout, moe: bool = False) -> dict[str, Gemm]:
    """The matmuls of one block's forward for one micro-batch on one tp rank [NAR, 2.3 and app. FLOPs]; an MoE expert's
    take ep x tokens x top_k / n_experts rows under balanced routing (why ep makes them efficient)."""
    m, t, s = workload.model, layout.tp, workload.seq_len
    s_local = local_seq(workload, layout)
    tokens = s_local * micro_batch_size(workload, layout)
    h = m.d_model
    qk, v = core_width(m)
    values = m.n_heads * v
    gemms = {
        "qkv": Gemm(2 * tokens * (attention_weights(m) - values * h) / t, _qkv_dims(m, tokens, t)),
        "proj": Gemm(2 * tokens * values * h / t, (tokens, values // t, h)),
        "attention": Gemm(2 * tokens * s * m.n_heads * (qk + v) / t * causal_share(m, s, workload.documents),
                          (s_local, qk, s), False),
    }
    inputs = 2 if m.gated_mlp else 1
    if not moe:
        return gemms | _mlp_gemms("mlp", tokens, tokens, m.d_ff, inputs, h, t)
    routed = moe_tokens(workload, layout)
    # each rank's experts take the copies of its etp group at 1/etp of the width: the same flops, other shapes
    etp = layout.etp
    rows = max(1, etp * layout.ep * routed * m.top_k // m.n_experts)
    gemms["router"] = Gemm(2 * routed * h * m.n_experts, (routed, h, m.n_experts), linear=False)
    gemms |= _mlp_gemms("experts", etp * routed * m.top_k, rows, m.expert_ff, inputs, h, etp,
                        linear=workload.pricing.fp8_experts)
    if m.n_shared_experts:
        gemms |= _mlp_gemms("shared", routed, routed, m.n_shared_experts * m.expert_ff, inputs, h, 1)
    return gemms


# Query and key rows of a fused attention kernel's tile, the unit it computes or skips whole: FlexAttention's block
# mask (torch.nn.attention.flex_attention, _DEFAULT_SPARSE_BLOCK_SIZE = 128), FlashAttention's largest blocks
# ({64, 128} x {64, 128} [Dao, FlashAttention-2, 2023, 3.3]).
KERNEL_TILE = 128


def causal_share(m: ModelShape, seq_len: int, documents: tuple[int, ...] = ()) -> float:
    """The part of the s x s score matrix the attention core computes, the mean over the layers: all of it for an
    unfused core (Megatron-LM in 2021 [NAR]); for a fused kernel, the tiles that hold at least one visible pair
    (:func:`tiled_pairs`), which under a causal mask is about half [Dao, FlashAttention-2, 2023, 3.1], and less in a
    layer within a sliding window shorter than s (all layers, or all but every ``global_every``-th) or with
    ``documents`` (the lengths of the documents packed into the sequences)."""
    documents = tuple(documents)
    window = m.sliding_window if m.sliding_window is not None and m.sliding_window < seq_len else None
    whole = tiled_pairs(seq_len, None, documents) / seq_len ** 2 if m.flash_attention or documents else 1.0
    if window is None:
        return whole
    local = m.local_layers / m.n_layers
    return local * tiled_pairs(seq_len, window, documents) / seq_len ** 2 + (1 - local) * whole


@functools.lru_cache(maxsize=4096)  # a search prices the same windows and documents for every layout
def tiled_pairs(seq_len: int, window: int | None, documents: tuple[int, ...]) -> float:
    """Query-key pairs a sequence's fused kernel computes, tiles masked in part included, per sequence of ``seq_len``
    tokens: the ``documents`` (cycled until they fill whole sequences, the last one cut at each sequence's end, as
    ``prepare`` packs them) or, without documents, one per sequence. A tile of queries from row a sees keys from the
    tile holding a's first visible key, max(its document's start, a - window + 1), to its own diagonal tile."""
    mix = np.asarray(documents or (seq_len,))
    sequences = max(1, math.ceil(mix.sum() / seq_len))
    starts = np.concatenate(([0], np.cumsum(np.tile(mix, math.ceil(sequences * seq_len / mix.sum())))))
    first_rows = np.arange(0, seq_len, KERNEL_TILE)
    rows = np.minimum(KERNEL_TILE, seq_len - first_rows)
    ends = np.minimum(first_rows + KERNEL_TILE, seq_len)
    total = 0
    for offset in range(0, sequences * seq_len, seq_len):
        document_start = starts[np.searchsorted(starts, offset + first_rows, side="right") - 1] - offset
        earliest = np.maximum(document_start, 0 if window is None else first_rows - window + 1)
        total += int((rows * (ends - earliest.clip(0) // KERNEL_TILE * KERNEL_TILE)).sum())
    return total / sequences


def document_saving(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """The share of the step time that masking attention to ``workload.documents`` saves over attention across
    the whole packed sequence."""
    unmasked = step_time(dataclasses.replace(workload, documents=()), layout, cluster).total
    return 1 - step_time(workload, layout, cluster).total / unmasked


def _qkv_dims(m: ModelShape, tokens: int, t: int) -> tuple[int, int, int]:
    """The q/k/v projection's matmul shape on one tp rank; latent attention's projections (down to the latents, up to
    the heads) are priced as one matmul of their FLOPs shaped as its key/value up-projection, the largest of them."""
    if not m.latent_attention:
        return tokens, m.d_model, m.qkv_width // t
    return tokens, m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim) // t


def _mlp_gemms(name: str, tokens: int, rows: int, f: int, inputs: int, h: int, t: int,
               linear: bool = True) -> dict[str, Gemm]:
    """An MLP's input and output matmuls over ``tokens`` rows in all, ``rows`` per matmul (``linear``: see
    :class:`Gemm`)."""
    return {f"{name}_in": Gemm(inputs * 2 * tokens * h * f / t, (rows, h, f // t), linear),
            f"{name}_out": Gemm(2 * tokens * f * h / t, (rows, f // t, h), linear)}


def gemm_time(gemm: Gemm, workload: Workload, cluster: Cluster) -> float:
    """Seconds of one matmul at :func:`gemm_efficiency`: a block's linear at the workload precision's peak
    (:meth:`Cluster.peak_at`), any other at the stored dtype's (:data:`STORED_AS`), else the 16-bit peak."""
    held = workload.precision if gemm.linear else STORED_AS.get(workload.precision, workload.precision)
    peak = cluster.peak_at(held) or cluster.peak_flops
    return gemm.flops / (peak * gemm_efficiency(cluster, gemm.dims))


def block_seconds(workload: Workload, layout: Layout, cluster: Cluster, moe: bool = False) -> float:
    """One block's forward and backward for one micro-batch: each matmul 3x (4x under full recomputation), the attention
    core per :func:`attention_core_seconds`; MoE adds the busiest ep rank's experts and the token movement."""
    passes = 4 if layout.recompute == "full" else 3
    gemms = block_gemms(workload, layout, moe)
    core = attention_core_seconds(gemms.pop("attention"), workload, layout, cluster)
    experts = {k: gemms.pop(k) for k in list(gemms) if k.startswith("experts")}
    matmuls = passes * sum(gemm_time(g, workload, cluster) for g in gemms.values()) + core
    if experts:
        matmuls += passes * sum(expert_gemm_seconds(g, workload, layout, cluster) for g in experts.values())
    if not cluster.memory_bw:
        return matmuls
    moved = block_elementwise_bytes(workload, layout, moe)
    if moe:
        moved += token_movement_bytes(workload, layout) + expert_elementwise_bytes(workload, layout, cluster)
    return matmuls + moved / cluster.memory_bw


# Elements a token streams through each element-wise kernel per element of its width, (forward, backward): an RMSNorm
# reads x and writes y, then reads x and dy and writes dx; a residual add reads two and writes one both ways (the
# backward adds the branch's gradient into the stream's); rotary reads and writes q and k; SwiGLU reads gate and up and
# writes one, then reads those and the gradient and writes two (GELU: 2 and 3).
NORM, RESIDUAL, ROTARY, GATED, PLAIN = (2, 3), (3, 3), (2, 2), (3, 5), (2, 3)
# Bytes of a float8 cast per element: read in bf16, written row- and column-wise in FP8 (torchao's and Transformer
# Engine's float8 linears keep both layouts, one for the forward matmul, one for the weight gradient's).
CAST_BYTES = 4


def block_elementwise_bytes(workload: Workload, layout: Layout, moe: bool = False) -> float:
    """Bytes one rank streams per micro-batch through a block's element-wise kernels beside the routed experts' own
    (:func:`expert_elementwise_bytes`): two norms and two residual adds over the rank's sequence slice, rotary (and
    q/k norms) over its heads, the dense MLP's or shared experts' activation, and under fp8 each float8 linear's casts
    of its input (forward) and output gradient (backward); the forward's once more under full recomputation."""
    m, lay, e = workload.model, layout, workload.dtype_bytes.activation
    tokens = local_seq(workload, lay) * micro_batch_size(workload, lay)
    stream = tokens // lay.tp if lay.sequence_parallel else tokens  # where the norms and residuals run
    heads = (m.n_heads + m.kv_heads) * m.head_size // lay.tp
    if m.latent_attention:
        heads = m.n_heads * m.qk_rope_head_dim // lay.tp + m.qk_rope_head_dim
    rotary = 0 if m.learned_positions else heads
    qk_norm = heads if m.qk_norm else 0
    if moe:
        act_tokens, act_width = moe_tokens(workload, lay), m.n_shared_experts * m.expert_ff
    else:
        act_tokens, act_width = tokens, m.d_ff // lay.tp
    act = GATED if m.gated_mlp else PLAIN
    reruns = 2 if lay.recompute == "full" else 1

    def passes(cost: tuple[int, int]) -> int:
        return reruns * cost[0] + cost[1]
    elements = (stream * m.d_model * 2 * (passes(NORM) + passes(RESIDUAL)) + tokens * rotary * passes(ROTARY)
                + tokens * qk_norm * passes(NORM) + act_tokens * act_width * passes(act))
    casts = 0.0
    if workload.precision == "fp8":
        for name, g in block_gemms(workload, lay, moe).items():
            if g.linear and not name.startswith("experts"):
                rows, inner, _ = g.dims
                casts += reruns * rows * inner + g.flops / (2 * inner)  # its input; its output's gradient
    return elements * e + CAST_BYTES * casts


def attention_core_seconds(core: Gemm, workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """The attention core's forward and backward for one micro-batch: a fused core on Hopper at ``Pricing.attention_kernel``'s
    measured rate (:func:`trainmesh.plan.kernels.attention_rates`); an unfused one, or one on a device without measured
    curves, as matmuls (docs/planner.md, "Kernel curves")."""
    if not (cluster.hopper and workload.model.flash_attention):
        passes = 4 if layout.recompute == "full" else 3
        return (passes + (layout.recompute == "selective")) * gemm_time(core, workload, cluster)
    fwd, bwd = attention_rates(workload.pricing.attention_kernel, core_width(workload.model)[0],
                               local_seq(workload, layout))
    scale = cluster.peak_flops / ATTENTION_PEAK
    forwards = 2 if layout.recompute in ("selective", "full") else 1
    return core.flops * (forwards / fwd + BACKWARD_FLOPS / bwd) / scale


def expert_gemm_seconds(gemm: Gemm, workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """One grouped routed-expert matmul on the busiest ep rank (:func:`trainmesh.plan.kernels.busiest_expert_rank`):
    the step waits for the rank with the most copies. On Hopper its rows per expert are priced at the measured
    grouped curve (:func:`trainmesh.plan.kernels.grouped_rows_share`), its widths as any matmul's."""
    copies = moe_tokens(workload, layout) * workload.model.top_k
    seconds = gemm_time(gemm, workload, cluster)
    if cluster.hopper:
        rows = gemm.dims[0]
        seconds *= rows / (rows + cluster.gemm_half_dim) / grouped_rows_share(rows)
    return seconds * busiest_expert_rank(layout.ep, copies)


def expert_elementwise_bytes(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """Bytes one rank streams per micro-batch through its routed experts' element-wise work (SwiGLU: 8f a copy), plus
    FP8 casts under ``Pricing.fp8_experts``; once more under full recomputation."""
    m, e = workload.model, workload.dtype_bytes.activation
    copies = moe_tokens(workload, layout) * m.top_k
    f = m.expert_ff
    act = (8 if m.gated_mlp else 4) * f * e
    casts = 0.0
    if workload.pricing.fp8_experts and workload.precision == "fp8" and cluster.peak_flops_fp8:
        casts = 4 * ((m.d_model + f) + (m.d_model + (2 if m.gated_mlp else 1) * f))
    rerun = (3 * f * e) if layout.recompute == "full" else 0.0
    return copies * (act + casts + rerun)


def token_movement_bytes(workload: Workload, layout: Layout) -> float:
    """Bytes one rank moves in memory taking a micro-batch's :func:`moe_tokens` to their experts and back (why
    fine-grained experts are slower than their FLOPs), counted once per movement as Megatron-LM's fused permute does
    [DSV3, 3.3.3]."""
    m, e = workload.model, workload.dtype_bytes.activation
    towards = DTYPE_BYTES[workload.pricing.dispatch_dtype] if workload.pricing.dispatch_dtype else e
    sorts = 2 if layout.ep > 1 else 1
    copies = m.top_k * m.d_model
    there = sorts * 2 * copies * towards + (sorts - 1) * 2 * copies * e
    router = 3 * m.n_experts * DTYPE_BYTES["fp32"]
    forward = router + there + (m.top_k + 1) * m.d_model * e
    backward = there + (2 * m.top_k + 1) * m.d_model * e
    reruns = 2 if layout.recompute == "full" else 1
    return moe_tokens(workload, layout) * (reruns * forward + backward)


def head_seconds(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """The output projection's forward and backward for one micro-batch on one tp rank (vocab-parallel)."""
    m = workload.model
    tokens = local_seq(workload, layout) * micro_batch_size(workload, layout)
    head = Gemm(head_flops_per_token(m.d_model, m.vocab_size) * tokens / layout.tp,
                (tokens, m.d_model, m.vocab_size // layout.tp), linear=False)
    return 3 * gemm_time(head, workload, cluster)


def layer_seconds(workload: Workload, layout: Layout, cluster: Cluster) -> tuple[tuple[float, ...], float]:
    """(each block's seconds in model order, the head's) for one micro-batch: what a stage split balances."""
    m = workload.model
    dense = block_seconds(workload, layout, cluster)
    moe = block_seconds(workload, layout, cluster, moe=True) if m.n_experts else dense
    blocks = tuple(moe if is_moe_layer(m, i) else dense for i in range(m.n_layers))
    return blocks, head_seconds(workload, layout, cluster)


def micro_compute_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Seconds of one micro-batch's forward and backward on a rank of ``stage``: its blocks
    (:func:`block_seconds`) and, on the last stage, the head."""
    dense, moe = stage_blocks(workload, layout, stage)
    total = dense * block_seconds(workload, layout, cluster) + (
        moe * block_seconds(workload, layout, cluster, moe=True) if moe else 0.0)
    return total + (head_seconds(workload, layout, cluster) if stage == layout.pp - 1 else 0.0)


def _tp_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """A dense block all-reduces its output twice forward and twice backward [NAR, 2.3], each an all-gather plus
    reduce-scatter under sp [KOR, 4.2.2]; an MoE block only its attention's half (:func:`_tp_partial_sums`).
    Under fp8 each float8 linear adds two all-reduces of its amaxes (16 bytes): latency, nearly all of it."""
    t, model = layout.tp, workload.model
    if t == 1:
        return 0.0
    sbh = local_seq(workload, layout) * micro_batch_size(workload, layout) * model.d_model
    nbytes, link = sbh * workload.dtype_bytes.activation, cluster.link(t)
    if layout.sequence_parallel:
        one = 2 * ring_gather_time(nbytes, t, link)
    else:
        one = all_reduce_time(nbytes, t, link)
    if workload.precision == "fp8":  # each of the block's 4 float8 linears all-reduces its amaxes fwd and bwd
        one += 2 * all_reduce_time(16, t, link)
    count = 6 if layout.recompute == "full" else 4
    dense, moe = stage_blocks(workload, layout, stage)
    return count * one * (dense + moe / 2)


def _tp_partial_sums(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Seconds a step spends summing over tp the gradients of what an MoE layer keeps whole on every tp rank,
    under sequence parallelism (``tensor_parallel.defer_tp_sums``): once a step, over the rank's ZeRO shard."""
    moe = stage_blocks(workload, layout, stage)[1]
    if layout.tp == 1 or not (moe and layout.sequence_parallel):
        return 0.0
    sharded = layout.zero > 0
    experts = 0 if layout.experts_over_tp else (  # folded: every tp rank's tokens reach its experts by all-to-all
        moe * expert_unit(workload.model, layout.ep, layout.etp).numel / (layout.expert_shard_ranks if sharded else 1))
    rest = moe * router_and_shared(workload.model).numel
    if layout.zero == 3:
        at_step, each_backward = experts, rest
    else:
        at_step, each_backward = experts + rest / (layout.grad_ranks if sharded else 1), 0

    def summed(n: float) -> float:
        return all_reduce_time(n * workload.dtype_bytes.grad, layout.tp, cluster.link(layout.tp)) if n else 0.0
    return summed(at_step) + layout.microbatches * summed(each_backward)


def _pp_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """One activation forward and one gradient backward per chunk boundary, split by t [NAR, 4.1]."""
    if layout.pp == 1:
        return 0.0
    bw, alpha = cluster.link(layout.world)
    nbytes = local_seq(workload, layout) * micro_batch_size(workload, layout) * workload.model.d_model // layout.tp
    return 2 * layout.virtual_stages * (alpha + nbytes * workload.dtype_bytes.activation / bw)


def cp_bytes_per_micro(workload: Workload, layout: Layout) -> dict[str, float]:
    """Bytes one rank sends over cp per micro-batch, per op as ``Comm`` counts them: ring (cp-1)/cp of each layer's
    K/V and its gradient [Liu et al., 2023, Ring Attention]; a2a q, k, v and output each way [Jacobs et al., 2023,
    Ulysses]."""
    m, lay, e = workload.model, layout, workload.dtype_bytes.activation
    cp, layers = lay.cp, most_blocks(workload, lay)
    if cp == 1:
        return {}
    tokens = local_seq(workload, lay) * micro_batch_size(workload, lay)
    # Latent attention goes over cp as the runtime sends it: each head's expanded key and its own-width value.
    kv = (tokens * m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) // lay.tp if m.latent_attention
          else 2 * tokens * m.kv_heads * m.head_size // lay.tp)
    if lay.cp_impl == "ring":
        grad = max(e, DTYPE_BYTES["fp32"])
        return {"ring_kv": layers * (cp - 1) * kv * e, "ring_kv_grad": layers * ((cp - 1) * kv * e + cp * kv * grad)}
    q_and_out = 2 * tokens * m.attention_width // lay.tp
    return {"all_to_all": layers * 2 * (cp - 1) / cp * (q_and_out + kv) * e}


def _cp_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """Exposed cp communication of one micro-batch. The ring's messages overlap the attention of the block
    at hand, so only what exceeds the attention's compute shows; the all-to-alls sit on the critical path."""
    sent = sum(cp_bytes_per_micro(workload, layout).values())
    if not sent:
        return 0.0
    bw, alpha = cluster.link(layout.tp * layout.cp)
    layers = most_blocks(workload, layout)
    if layout.cp_impl == "a2a":
        return 8 * layers * alpha + sent / bw
    attention = block_gemms(workload, layout)["attention"]
    hidden = layers * attention_core_seconds(attention, workload, dataclasses.replace(layout, recompute="none"),
                                             cluster)  # the core as it runs (causal_share)
    messages = layers * (3 * layout.cp - 2)
    return max(0.0, messages * alpha + sent / bw - hidden)


def all_to_all_bytes_per_micro(workload: Workload, layout: Layout, stage: int) -> float:
    """Bytes one rank of ``stage`` sends over ep per micro-batch in the activations' dtype: (ep-1)/ep of the
    :func:`routed_copy_bytes` dispatched and combined in each of its :func:`_all_to_all_rounds`."""
    rounds = _all_to_all_rounds(workload, layout, stage)
    if not rounds:
        return 0.0
    one = routed_copy_bytes(workload, layout, workload.dtype_bytes.activation) * (layout.ep - 1) / layout.ep
    return rounds * 2 * one


def _all_to_all_rounds(workload: Workload, layout: Layout, stage: int) -> int:
    """A rank of ``stage``'s dispatch-and-combine rounds per micro-batch: one per MoE layer and pass (forward,
    backward, and the forward again under full recomputation); 0 without expert parallelism."""
    moe = stage_blocks(workload, layout, stage)[1]
    if layout.ep * layout.etp == 1 or not moe:
        return 0
    return moe * (3 if layout.recompute == "full" else 2)


def routed_copy_bytes(workload: Workload, layout: Layout, element_bytes: float) -> float:
    """The top_k copies of a micro-batch's :func:`moe_tokens`, ``element_bytes`` each: each tp rank dispatches its own
    tokens' copies, all of them without sequence parallelism, a 1/tp slice under it."""
    m = workload.model
    return moe_tokens(workload, layout) * m.top_k * m.d_model * element_bytes


def _ep_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """One micro-batch's expert all-to-alls on a rank of ``stage``: per :func:`_all_to_all_rounds`, one towards
    the experts in ``pricing.dispatch_dtype`` and one back (:func:`all_to_all_seconds`), each followed over etp by
    the gather of the copies and the sum of the partial outputs (:func:`etp_seconds`)."""
    rounds = _all_to_all_rounds(workload, layout, stage)
    if not rounds:
        return 0.0
    activation = workload.dtype_bytes.activation
    dispatch = DTYPE_BYTES[workload.pricing.dispatch_dtype] if workload.pricing.dispatch_dtype else activation
    ways = ((dispatch, False), (activation, True))
    return rounds * sum((all_to_all_seconds(workload, layout, cluster, e, combine) if layout.ep > 1 else 0.0)
                        + etp_seconds(workload, layout, cluster, e) for e, combine in ways)


def etp_seconds(workload: Workload, layout: Layout, cluster: Cluster, element_bytes: float) -> float:
    """One all-to-all over etp of the copies a rank's experts received: each rank sends all of its own to the etp - 1
    others (and gets their partial outputs back alike), over ranks tp apart unless the experts fold over tp."""
    if layout.etp == 1:
        return 0.0
    bw, alpha = cluster.link(layout.etp * (1 if layout.experts_over_tp else layout.tp))
    return (layout.etp - 1) * (alpha + routed_copy_bytes(workload, layout, element_bytes) / bw)


def all_to_all_seconds(workload: Workload, layout: Layout, cluster: Cluster, element_bytes: float,
                       combine: bool = False) -> float:
    """One all-to-all of a micro-batch's top_k token copies over the ep group (a dispatch, or a ``combine``), at the
    slower of NIC and NVLink across nodes. Under ``pricing.forward_dispatch`` DeepEP's kernels run it: across nodes
    once per node holding a token's experts, as DeepSeek-V3 does [DSV3, 2.1.2 and 3.2.2], each link at the share
    of it those kernels measure (:func:`trainmesh.plan.kernels.deepep_shares`)."""
    m, lay = workload.model, layout
    copies = routed_copy_bytes(workload, lay, element_bytes)
    nodes = -(-lay.ep_span // cluster.gpus_per_node)
    forwarded = workload.pricing.forward_dispatch
    nic_share, nvlink_share = deepep_shares(lay.ep, combine)
    if nodes < 2:
        bw, alpha = cluster.link(lay.ep_span)
        bw = cluster.intra_bw * nvlink_share if forwarded else bw
        return (lay.ep - 1) * (alpha + copies / (lay.ep * bw))
    (inter, alpha), (intra, _) = cluster.link(cluster.gpus_per_node + 1), cluster.link(1)
    if forwarded:
        crossing = copies / m.top_k * nodes_per_token(m, nodes) * (nodes - 1) / nodes
        nic, nvlink = cluster.inter_bw * nic_share, cluster.intra_bw * nvlink_share
        return (nodes - 1) * alpha + max(crossing / nic, copies / nvlink)
    beside = copies * (lay.ep // nodes - 1) / lay.ep
    return (lay.ep - 1) * alpha + max(copies * (nodes - 1) / nodes / inter, beside / intra)


def nodes_per_token(m: ModelShape, nodes: int) -> float:
    """Nodes of an ep group that a token's top_k experts lie on: bounded by ``groups_per_token`` under
    group-limited routing, else the expected count nodes x (1 - C(E - E/nodes, k) / C(E, k))."""
    if m.groups_per_token:
        return min(m.top_k, nodes, m.groups_per_token * max(1, nodes // m.expert_groups))
    elsewhere = m.n_experts - m.n_experts // nodes
    return nodes * (1 - math.comb(elsewhere, m.top_k) / math.comb(m.n_experts, m.top_k))


def exposed_ep_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int, compute: float) -> float:
    """What of one micro-batch's expert all-to-alls shows beside ``compute``: all of it, unless
    ``pricing.a2a_overlap`` pairs micro-batches as DualPipe does [DSV3, 3.2.1]: max(0, a2a - compute)."""
    a2a = _ep_time_per_micro(workload, layout, cluster, stage)
    return max(0.0, a2a - compute) if workload.pricing.a2a_overlap else a2a


def dp_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Seconds of one step's data-parallel traffic on a rank of ``stage``, inside and across nodes
    (:func:`trainmesh.plan.dp_traffic.dp_traffic`), hidden or not."""
    return dp_traffic(workload, layout, cluster, stage).seconds


def exposed_dp_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int, compute: float) -> float:
    """What of :func:`dp_time` shows beside ``compute`` seconds: ZeRO-3's prefetched collectives only past the compute
    where comm overlaps it, other reductions whole [NAR, Table 2] (compared with measurements in docs/planner.md)."""
    traffic = dp_traffic(workload, layout, cluster, stage)
    hidden = min(traffic.prefetched, compute) if cluster.comm_overlaps_compute else 0.0
    return traffic.seconds - hidden


def peak_flops(workload: Workload, cluster: Cluster) -> float:
    """The peak MFU divides by, as the runtime's (:func:`trainmesh.tracking.metrics.peak_tflops`): the precision's
    (fp64 at the fp32 peak, fp8 at FP8's), the 16-bit peak on a device without FP8 tensor cores."""
    return cluster.peak_at(workload.precision) or cluster.peak_flops


def most_blocks(workload: Workload, layout: Layout) -> int:
    """Blocks of the rank that holds the most."""
    return max(sum(stage_blocks(workload, layout, s)) for s in candidate_stages(workload, layout))


def step_time(workload: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    """Predicted step time: the slowest stage's micro-batches, the bubble sum(t_s) - max(t_s) scaled per schedule
    [NAR, 2.2], then dp traffic; with ``ranks_per_core`` r > 1 compute takes r times as long."""
    check_layout(workload, layout)
    m = layout.microbatches
    kinds = stage_kinds(workload.model, stage_split(workload, layout), layout.pp)
    per_stage = {s: _stage_micro_times(workload, layout, cluster, s) for s, _ in kinds}
    compute = m * max(c for c, _, _ in per_stage.values())
    tp = max(m * t + _tp_partial_sums(workload, layout, cluster, s) for s, (_, t, _) in per_stage.items())
    pp_time = m * _pp_time_per_micro(workload, layout, cluster)
    ep = m * max(e for _, _, e in per_stage.values())
    bubble = pipeline_bubble([sum(per_stage[s]) + pp_time / m for s, n in kinds for _ in range(n)], layout)
    if cluster.ranks_per_core > 1:  # cores shared: each rank's compute waits its turn, bubbles are filled
        shared = compute * cluster.ranks_per_core
        compute, bubble = shared, max(0.0, compute + bubble - shared)
    dp = max(exposed_dp_time(workload, layout, cluster, s, m * per_stage[s][0]) for s in per_stage)
    cp = m * _cp_time_per_micro(workload, layout, cluster)
    return TimeBreakdown(compute, dp, tp, pp_time, bubble, cp, ep)


def _stage_micro_times(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> tuple[float, float, float]:
    """(compute, tp, exposed ep) seconds of one micro-batch on a rank of ``stage``; compute on the compute
    units the communication kernels leave (``workload.pricing.comm_sm_share``)."""
    compute = micro_compute_time(workload, layout, cluster, stage) / (1 - workload.pricing.comm_sm_share)
    return (compute, _tp_time_per_micro(workload, layout, cluster, stage),
            exposed_ep_time(workload, layout, cluster, stage, compute))


def pipeline_bubble(stage_times: list[float], layout: Layout) -> float:
    """Seconds the pipeline adds to m times its slowest stage: the fill and drain sum(t) - max(t), (p-1)t for
    equal stages [NAR, 2.2.1], scaled per schedule as :func:`bubble_fraction` does."""
    pp, m = layout.pp, layout.microbatches
    if pp == 1:
        return 0.0
    f = bubble_fraction(layout.schedule, pp, m, layout.virtual_stages)
    return (sum(stage_times) - max(stage_times)) * m / (pp - 1) * f / (1 - f)
