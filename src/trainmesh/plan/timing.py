"""Time of one step: each matmul at its own efficiency, the collectives of every axis (tp, cp, ep, pp, dp)
on the critical path, and the pipeline's bubble. Communication is assumed not to overlap compute, except
where noted (the ring's messages behind attention; ZeRO-3's prefetched gathers and reduce-scatters behind
the compute of the units around them; the expert all-to-all behind another micro-batch's compute where the
schedule pairs them, ``Pricing.a2a_overlap``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainmesh.tracking.metrics import head_flops_per_token
from trainmesh.models.spec import ModelShape
from trainmesh.distributed.hardware import Cluster
from trainmesh.plan.dp_traffic import all_reduce_time, dp_traffic, ring_gather_time
from trainmesh.plan.flops import (attention_forward_flops, attention_weights, block_forward_flops, core_width,
                                  is_moe_layer)
from trainmesh.plan.kernels import ATTENTION_PEAK, BACKWARD_FLOPS, attention_rates, busiest_expert_rank
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
    fwd = block_forward_flops(m, seq_len)
    core = attention_forward_flops(m, seq_len) - 2 * attention_weights(m)
    return {"none": 3 * fwd, "selective": 3 * fwd + core, "full": 4 * fwd}[recompute]


def step_flops(workload: Workload, recompute: str = "none") -> float:
    """FLOPs of one step.

    With ``recompute="none"`` these are the model FLOPs that MFU counts [PALM, app. B], the ones
    :func:`trainmesh.tracking.metrics.model_flops_per_token` gives the runtime's MFU; with the layout's recompute,
    the FLOPs the devices execute, which Megatron-LM reports [NAR, app. FLOPs].
    """
    m, s = workload.model, workload.seq_len
    moe_layers = m.n_layers - m.n_dense_layers if m.n_experts else 0
    blocks = (m.n_layers - moe_layers) * block_forward_flops(m, s) + moe_layers * block_forward_flops(m, s, moe=True)
    model = 3 * (blocks + head_flops_per_token(m.d_model, m.vocab_size))
    rerun = m.n_layers * (block_pass_flops_per_token(m, s, recompute) - block_pass_flops_per_token(m, s, "none"))
    if recompute == "full":
        rerun = model / 3 - head_flops_per_token(m.d_model, m.vocab_size)  # every block's forward, once more
    return workload.global_batch * s * (model + rerun)


@dataclass(frozen=True)
class Gemm:
    """One matmul of a forward pass on one rank: its FLOPs, its (m, k, n) after the tp split, and whether it
    is one of the block's linear layers ``precision="fp8"`` runs in float8 (the attention core, the router
    and the head stay bf16, as :attr:`trainmesh.models.spec.ModelSpec.high_precision` keeps them and
    DeepSeek-V3's FP8 recipe does [DSV3, 3.3.1]; so do trainmesh's grouped routed experts, unless
    ``Pricing.fp8_experts`` prices a run whose experts are float8)."""

    flops: float
    dims: tuple[int, int, int]
    linear: bool = True


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
    qk, v = core_width(m)
    values = m.n_heads * v
    gemms = {
        "qkv": Gemm(2 * tokens * (attention_weights(m) - values * h) / t, _qkv_dims(m, tokens, t)),
        "proj": Gemm(2 * tokens * values * h / t, (tokens, values // t, h)),
        "attention": Gemm(2 * tokens * workload.seq_len * m.n_heads * (qk + v) / t * causal_share(m),
                          (s_local, qk, workload.seq_len), linear=False),
    }
    inputs = 2 if m.gated_mlp else 1
    if not moe:
        return gemms | _mlp_gemms("mlp", tokens, tokens, m.d_ff, inputs, h, t)
    routed = moe_tokens(workload, layout)
    rows = max(1, layout.ep * routed * m.top_k // m.n_experts)
    gemms["router"] = Gemm(2 * routed * h * m.n_experts, (routed, h, m.n_experts), linear=False)
    gemms |= _mlp_gemms("experts", routed * m.top_k, rows, m.expert_ff, inputs, h, 1, linear=workload.pricing.fp8_experts)
    if m.n_shared_experts:
        gemms |= _mlp_gemms("shared", routed, routed, m.n_shared_experts * m.expert_ff, inputs, h, 1)
    return gemms


def causal_share(m: ModelShape) -> float:
    """The part of the s x s score matrix the attention core computes: a fused (flash) kernel skips the
    blocks a causal mask hides, half of them [Dao, FlashAttention-2, 2023, 3.1]; an unfused core computes
    the whole matrix and masks it (Megatron-LM in 2021 [NAR])."""
    return 0.5 if m.flash_attention else 1.0


def _qkv_dims(m: ModelShape, tokens: int, t: int) -> tuple[int, int, int]:
    """The q/k/v projection's matmul shape on one tp rank; latent attention's projections (down to the
    latents, up to the heads) are priced as one matmul of their FLOPs shaped as its key/value up-projection,
    the largest of them."""
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
    """Seconds of one matmul at its shape's :func:`gemm_efficiency`: a block's linear at the peak of the
    workload's precision (FP8's under fp8, :meth:`Cluster.peak_at`), any other at the peak of the dtype the
    activations are held in (bf16 under fp8, :data:`STORED_AS`); the 16-bit peak where the device has none."""
    held = workload.precision if gemm.linear else STORED_AS.get(workload.precision, workload.precision)
    peak = cluster.peak_at(held) or cluster.peak_flops
    return gemm.flops / (peak * gemm_efficiency(cluster, gemm.dims))


def block_seconds(workload: Workload, layout: Layout, cluster: Cluster, moe: bool = False) -> float:
    """One block's forward and backward for one micro-batch: each matmul of :func:`block_gemms` at its own
    :func:`gemm_efficiency`, three times (backward costs twice the forward), four under full
    recomputation; the attention core as :func:`attention_core_seconds` prices it. An MoE block's routed
    experts run on the busiest rank of the ep group (:func:`expert_gemm_seconds`), and it also
    streams its tokens to and from its experts and through its experts' element-wise work
    (:func:`token_movement_bytes`, :func:`expert_elementwise_bytes`) at ``cluster.memory_bw``."""
    passes = 4 if layout.recompute == "full" else 3
    gemms = block_gemms(workload, layout, moe)
    core = attention_core_seconds(gemms.pop("attention"), workload, layout, cluster)
    experts = {k: gemms.pop(k) for k in list(gemms) if k.startswith("experts")}
    matmuls = passes * sum(gemm_time(g, workload, cluster) for g in gemms.values()) + core
    if experts:
        matmuls += passes * sum(expert_gemm_seconds(g, workload, layout, cluster) for g in experts.values())
    if not (moe and cluster.memory_bw):
        return matmuls
    moved = token_movement_bytes(workload, layout) + expert_elementwise_bytes(workload, layout, cluster)
    return matmuls + moved / cluster.memory_bw


def attention_core_seconds(core: Gemm, workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """The attention core's forward and backward for one micro-batch, with its rerun under recomputation.

    Where a run names its kernel (``Pricing.attention_kernel``), a fused core on an H100-class device
    (``cluster.hopper``) runs at that kernel's measured rate at its head dimension and the keys one call sees (the sequence, or under
    cp one ring step's s / cp), :func:`trainmesh.plan.kernels.attention_rates`: forward F at the forward
    rate, backward 2.5 F at the backward one (the FLOPs the papers count). Otherwise, by default, as
    matmuls of head_dim-wide blocks at :func:`gemm_efficiency`, the pricing the dense fit rests on
    (docs/planner.md, "Kernel curves": the measured curves are faster, and with them no one efficiency
    holds the dense rows and brings the MoE ones closer)."""
    if not (workload.pricing.attention_kernel and cluster.hopper and workload.model.flash_attention):
        passes = 4 if layout.recompute == "full" else 3
        return (passes + (layout.recompute == "selective")) * gemm_time(core, workload, cluster)
    fwd, bwd = attention_rates(workload.pricing.attention_kernel, core_width(workload.model)[0],
                               local_seq(workload, layout))
    scale = cluster.peak_flops / ATTENTION_PEAK
    forwards = 2 if layout.recompute in ("selective", "full") else 1
    return core.flops * (forwards / fwd + BACKWARD_FLOPS / bwd) / scale


def expert_gemm_seconds(gemm: Gemm, workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """One routed-expert grouped matmul of a forward at :func:`gemm_efficiency` of its rows per expert, on the
    busiest rank of the ep group, whose load :func:`trainmesh.plan.kernels.busiest_expert_rank` sizes under
    balanced routing: the step waits for the rank that received the most copies."""
    copies = moe_tokens(workload, layout) * workload.model.top_k
    return gemm_time(gemm, workload, cluster) * busiest_expert_rank(layout.ep, copies)


def expert_elementwise_bytes(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """Bytes one rank streams per micro-batch through its routed experts' element-wise work, which scales
    with tokens x top_k x width: the gated activation (SwiGLU reads gate and up, 2f, and writes f forward;
    backward reads both and the output's gradient and writes both gradients: 8f elements a copy, in the
    activations' dtype), and, where the experts multiply in FP8 (``Pricing.fp8_experts``) on a device with
    FP8 tensor cores, the casts with per-tile scales before each grouped matmul: the input read in bf16 and
    written in FP8 row-wise and column-wise (the backward's weight gradient reads the transpose on Hopper),
    4 bytes an element, for the inputs of both matmuls (d and f) forward and their output gradients (d and
    2f) backward. Once more forward under full recomputation."""
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
    """Bytes one rank reads and writes in device memory to take one micro-batch's :func:`moe_tokens` to their
    experts and back, forward and backward: the work of an MoE layer that a dense block does not do, and
    what makes fine-grained experts (many narrow ones, a token copied top_k times) slower than their FLOPs.

    Each movement is counted once, as fused kernels do it (Megatron-LM's permute and unpermute): the router's
    fp32 scores written, normalised and read by top-k (3 x n_experts x 4 bytes a token); the token's top_k
    copies gathered into expert order (read and written, 2 k d elements), and with ep > 1 sorted once more by
    local expert after the all-to-all; back the other way, the unsort, then the weighted sum of the k copies
    into one token ((k + 1) d). Backward moves the gradients the same way, the combine's twice over (the
    copies' gradients written, and the copies read again for the routing weights' gradient: (2k + 1) d). The
    movements towards the experts are in ``workload.pricing.dispatch_dtype`` (quantised before they move, [DSV3,
    3.3.3]), the rest in the activations' dtype. trainmesh's own combine is not fused (a zero-filled
    index_copy, then a multiply and a sum: (6k + 1) d), so it moves more than this floor."""
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
    """Each dense block all-reduces its sbh output twice forward and twice backward (twice more when the
    forward is recomputed) [NAR, 2.3]; sequence parallelism turns each into an all-gather plus a
    reduce-scatter of the same volume [KOR, 4.2.2]. An MoE block has only its attention's half: its router
    and experts are whole on every tp rank, so the MoE layer needs no tp collective of activations (their
    gradients' sum over tp is :func:`_tp_partial_sums`)."""
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
    dense, moe = stage_blocks(workload, layout, stage)
    return count * one * (dense + moe / 2)


def _tp_partial_sums(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Seconds a step spends summing over tp the gradients of what an MoE layer keeps whole on
    every tp rank, under sequence parallelism, where each tp rank routes only its slice of the tokens
    (``tensor_parallel.defer_tp_sums``): the gradient engine sums them once a step, after its own reduction
    over dp (so under ZeRO only the rank's shard: 1/edp of the routed experts, 1/(dp cp) of the router and
    shared experts); ZeRO-3 does so for the routed experts, its units of their own, while the router and the
    shared experts share their block's unit with tp-split weights and are summed after every backward."""
    moe = stage_blocks(workload, layout, stage)[1]
    if layout.tp == 1 or not (moe and layout.sequence_parallel):
        return 0.0
    sharded = layout.zero > 0
    experts = 0 if layout.experts_over_tp else (  # folded: every tp rank's tokens reach its experts by all-to-all
        moe * expert_unit(workload.model, layout.ep).numel / (layout.expert_shard_ranks if sharded else 1))
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
    """Bytes one rank sends over cp for one micro-batch's forward and backward, per op, as
    :class:`trainmesh.distributed.comm.Comm` counts them (``cp/ring_kv`` ...).

    Ring: a layer's local K/V block (2 b (s/cp) kv_heads d_head elements) is sent cp-1 times forward, and
    in backward cp-1 times again plus its gradient cp times (fp32 or wider: the accumulation dtype), i.e.
    (cp-1)/cp of the layer's whole K/V per direction [Liu et al., 2023, Ring Attention]. a2a: q, k, v and
    the output go through one all-to-all each way, (cp-1)/cp of each tensor [Jacobs et al., 2023, Ulysses].
    """
    m, lay, e = workload.model, layout, workload.dtype_bytes.activation
    cp, layers = lay.cp, most_blocks(workload, lay)
    if cp == 1:
        return {}
    tokens = local_seq(workload, lay) * micro_batch_size(workload, lay)
    # Latent attention's keys and values are one compressed vector per token plus the shared rotary key.
    kv = (tokens * (m.kv_lora_rank + m.qk_rope_head_dim) if m.latent_attention
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
    """Bytes one rank of ``stage`` sends over ep for one micro-batch in the activations' dtype: each of its
    :func:`_all_to_all_rounds` dispatches and combines the :func:`routed_copy_bytes` of its tokens, of which
    (ep-1)/ep leave the rank."""
    rounds = _all_to_all_rounds(workload, layout, stage)
    if not rounds:
        return 0.0
    one = routed_copy_bytes(workload, layout, workload.dtype_bytes.activation) * (layout.ep - 1) / layout.ep
    return rounds * 2 * one


def _all_to_all_rounds(workload: Workload, layout: Layout, stage: int) -> int:
    """A rank of ``stage``'s dispatch-and-combine rounds per micro-batch: one per MoE layer and pass (forward,
    backward, and the forward again under full recomputation); 0 without expert parallelism."""
    moe = stage_blocks(workload, layout, stage)[1]
    if layout.ep == 1 or not moe:
        return 0
    return moe * (3 if layout.recompute == "full" else 2)


def routed_copy_bytes(workload: Workload, layout: Layout, element_bytes: float) -> float:
    """The top_k copies of a micro-batch's :func:`moe_tokens`, ``element_bytes`` per element. Each tp rank
    dispatches the copies of its own tokens over its own ep group: all of its micro-batch's tokens without
    sequence parallelism (every tp rank sends the same copies), a 1/tp slice under it."""
    m = workload.model
    return moe_tokens(workload, layout) * m.top_k * m.d_model * element_bytes


def _ep_time_per_micro(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """One micro-batch's expert all-to-alls on a rank of ``stage``, on the critical path: in each of its
    :func:`_all_to_all_rounds` one towards the experts, in ``workload.pricing.dispatch_dtype``, and one back, in the
    activations' dtype (:func:`all_to_all_seconds`); in the activations' dtype throughout, the bytes of
    :func:`all_to_all_bytes_per_micro`."""
    rounds = _all_to_all_rounds(workload, layout, stage)
    if not rounds:
        return 0.0
    activation = workload.dtype_bytes.activation
    dispatch = DTYPE_BYTES[workload.pricing.dispatch_dtype] if workload.pricing.dispatch_dtype else activation
    return rounds * sum(all_to_all_seconds(workload, layout, cluster, e) for e in (dispatch, activation))


def all_to_all_seconds(workload: Workload, layout: Layout, cluster: Cluster, element_bytes: float) -> float:
    """One all-to-all of a micro-batch's top_k copies of its :func:`moe_tokens` over the ep group (ep ranks tp
    apart, so across tp x ep ranks, or under sequence parallelism ep consecutive ones: ``Layout.ep_span``),
    ``element_bytes`` per element.

    On one node (ep-1)/ep of the copies leave the rank, in ep - 1 messages, at NVLink's pace. A group over
    several nodes moves its bytes on two links at once, each rank's NIC and its NVLink, and the slower sets
    the pace. Sent straight to their ranks (trainmesh's all-to-all, as NCCL's), the copies bound for the
    other nodes, (nodes-1)/nodes of them, cross the NIC, and those for the other ranks of the sender's node
    go over NVLink. Under ``workload.pricing.forward_dispatch`` a token crosses once to each other node holding one of
    its experts (:func:`nodes_per_token`, which group-limited routing bounds), and NVLink there carries its
    copies to their ranks, as DeepSeek-V3's dispatch does for its node-limited routing [DSV3, 2.1.2 and
    3.2.2]."""
    m, lay = workload.model, layout
    copies = routed_copy_bytes(workload, lay, element_bytes)
    nodes = -(-lay.ep_span // cluster.gpus_per_node)
    if nodes < 2:
        bw, alpha = cluster.link(lay.ep_span)
        return (lay.ep - 1) * (alpha + copies / (lay.ep * bw))
    (inter, alpha), (intra, _) = cluster.link(cluster.gpus_per_node + 1), cluster.link(1)
    if workload.pricing.forward_dispatch:
        crossing = copies / m.top_k * nodes_per_token(m, nodes) * (nodes - 1) / nodes
        return (nodes - 1) * alpha + max(crossing / inter, copies / intra)
    beside = copies * (lay.ep // nodes - 1) / lay.ep
    return (lay.ep - 1) * alpha + max(copies * (nodes - 1) / nodes / inter, beside / intra)


def nodes_per_token(m: ModelShape, nodes: int) -> float:
    """The nodes of an ep group over ``nodes`` nodes that a token's top_k experts lie on. Under group-limited
    routing at most its ``groups_per_token`` groups' nodes (each group over nodes / ``expert_groups`` nodes,
    at least one), and no more than top_k or all of them; otherwise, with balanced routing, the expected
    number of nodes its top_k distinct experts fall on, a node holding n_experts / nodes of them:
    nodes x (1 - C(E - E/nodes, k) / C(E, k))."""
    if m.groups_per_token:
        return min(m.top_k, nodes, m.groups_per_token * max(1, nodes // m.expert_groups))
    elsewhere = m.n_experts - m.n_experts // nodes
    return nodes * (1 - math.comb(elsewhere, m.top_k) / math.comb(m.n_experts, m.top_k))


def exposed_ep_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int, compute: float) -> float:
    """What of one micro-batch's expert all-to-alls (:func:`_ep_time_per_micro`) shows on a rank of ``stage``
    whose compute per micro-batch is ``compute``: all of it, unless the schedule pairs micro-batches
    (``workload.pricing.a2a_overlap``): then a micro-batch's dispatch and combine run while the paired one computes, as
    DualPipe overlaps a forward chunk's all-to-alls with a backward chunk's compute and the other way round
    [DSV3, 3.2.1], and only what exceeds that compute shows, max(0, a2a - compute)."""
    a2a = _ep_time_per_micro(workload, layout, cluster, stage)
    return max(0.0, a2a - compute) if workload.pricing.a2a_overlap else a2a


def dp_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int) -> float:
    """Seconds of one step's data-parallel traffic on a rank of ``stage``, inside and across nodes
    (:func:`trainmesh.plan.dp_traffic.dp_traffic`), hidden or not."""
    return dp_traffic(workload, layout, cluster, stage).seconds


def exposed_dp_time(workload: Workload, layout: Layout, cluster: Cluster, stage: int, compute: float) -> float:
    """What of :func:`dp_time` shows on a rank of ``stage`` that computes for ``compute`` seconds a step.

    ZeRO-3's per-unit collectives are issued ahead of the compute that needs them (``DpTraffic.prefetched``),
    so on a device where communication runs beside compute (``cluster.comm_overlaps_compute``) they show only
    where they outlast it; the gradient reductions of ZeRO-0/1/2 and hybrid sharding's replica all-reduce
    wait for the backward that produces them and show whole. That is what [NAR, Table 2] measured: ZeRO-3
    alone on 384 A100s ran 144 TFLOP/s per GPU, as fast as its gathers allow (145 predicted so, 85 with the
    gathers exposed), and Megatron-LM of 2021 all-reduced gradients after the backward, as the SC21 fit
    (:data:`trainmesh.distributed.hardware.GPU_EFFICIENCY`) prices it."""
    traffic = dp_traffic(workload, layout, cluster, stage)
    hidden = min(traffic.prefetched, compute) if cluster.comm_overlaps_compute else 0.0
    return traffic.seconds - hidden


def peak_flops(workload: Workload, cluster: Cluster) -> float:
    """The peak MFU divides by, as the runtime's MFU does (:func:`trainmesh.tracking.metrics.peak_tflops`): the
    precision's (fp64 at the fp32 peak: A100's and H100's fp64 tensor cores match their fp32 rate; fp8 at
    the FP8 one), the 16-bit peak on a device without FP8 tensor cores (CPU ranks emulate float8)."""
    return cluster.peak_at(workload.precision) or cluster.peak_flops


def most_blocks(workload: Workload, layout: Layout) -> int:
    """Blocks of the rank that holds the most."""
    return max(sum(stage_blocks(workload, layout, s)) for s in candidate_stages(workload, layout))


def step_time(workload: Workload, layout: Layout, cluster: Cluster) -> TimeBreakdown:
    """Predicted step time: the slowest stage's micro-batches, the bubble around them, then dp traffic.

    Compute is each matmul's FLOPs at its own efficiency (:func:`micro_compute_time`); tp and pp traffic sit on
    the critical path. The bubble is the pipeline's fill and drain: every stage's time per micro-batch but
    the slowest one's, sum(t_s) - max(t_s), which with uniform stages is (p-1)t and matches the closed forms
    of :func:`bubble_fraction` [NAR, 2.2], scaled as they are by the schedule (1/v interleaved, 1/3 ZB-H1);
    with uneven stages (``--stage-layers``) the real split's times count. Where ranks share cores
    (``ranks_per_core`` r > 1: more CPU processes than cores), computing takes r times as long, and a
    rank's bubble is time the others compute in, so only what the bubble adds beyond that shows.
    """
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
    """Seconds the pipeline adds to m times its slowest stage, given each stage's time per micro-batch: the
    fill and drain through every other stage, sum(t) - max(t), which is (p-1)t for equal stages [NAR,
    2.2.1], shortened as :func:`bubble_fraction` shortens it for the schedule (1/v interleaved, 1/3 ZB-H1).
    For uneven stages it is what a pipeline whose slowest stage paces the steady state pays; the schedule
    simulator (:mod:`trainmesh.pipeline.simulate`) agrees within a few percent of the step, exactly when
    the lighter stages come first."""
    pp, m = layout.pp, layout.microbatches
    if pp == 1:
        return 0.0
    f = bubble_fraction(layout.schedule, pp, m, layout.virtual_stages)
    return (sum(stage_times) - max(stage_times)) * m / (pp - 1) * f / (1 - f)
