"""Memory of one rank: parameters per ZeRO unit, model state under ZeRO, activations kept for backward,
and transient buffers, stage by stage (conventions as in :mod:`trainmesh.plan`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trainmesh.models.spec import ModelShape
from trainmesh.plan.stages import rank_blocks, stage_kinds
from trainmesh.layout import Layout
from trainmesh.plan.workload import Workload, check_layout, local_seq, micro_batch_size, stage_split
from trainmesh.training.state_bytes import DTYPE_BYTES, STEP_SCALAR_BYTES, sharded_state_bytes


@dataclass(frozen=True)
class UnitSize:
    """Parameters one rank holds of one ZeRO unit after tensor parallelism: elements and tensors."""

    numel: int
    tensors: int


def _norm(m: ModelShape) -> UnitSize:
    """LayerNorm (weight and bias) or RMSNorm (weight only); replicated across tp ranks."""
    return UnitSize(m.d_model * (2 if m.bias else 1), 2 if m.bias else 1)


def _linear(n_in: int, n_out: int, tp: int, bias: bool, bias_sharded: bool) -> UnitSize:
    """A Megatron-sharded linear: weight split by tp, column-parallel bias split, row-parallel bias not."""
    bias_numel = (n_out // tp if bias_sharded else n_out) if bias else 0
    return UnitSize(n_in * n_out // tp + bias_numel, 2 if bias else 1)


def _sum(units: list[UnitSize]) -> UnitSize:
    return UnitSize(sum(u.numel for u in units), sum(u.tensors for u in units))


def _mlp(m: ModelShape, f: int, tp: int, bias: bool) -> list[UnitSize]:
    """An MLP of hidden size ``f``: input projection(s) column-parallel, output row-parallel [NAR, 2.3]."""
    d = m.d_model
    return [_linear(d, f, tp, bias, True)] * (2 if m.gated_mlp else 1) + [_linear(f, d, tp, bias, False)]


def block_unit(m: ModelShape, tp: int, moe: bool = False) -> UnitSize:
    """One block: qkv and MLP-in column-parallel, attention and MLP out row-parallel [NAR, 2.3]. An MoE block
    holds the router and shared experts whole on every tp rank; its routed experts are :func:`expert_unit`."""
    d, b = m.d_model, m.bias
    if m.latent_attention:  # its down projections and latent norms whole on every tp rank, the rest split
        down = (d + 1) * (m.q_lora_rank + m.kv_lora_rank) + d * m.qk_rope_head_dim
        split = m.attention_params() - down
        attention = [_norm(m), UnitSize(down + split // tp, 7 if m.q_lora_rank else 5), _norm(m)]
    else:
        attention = [_norm(m), _linear(d, m.qkv_width, tp, b or m.sinks, True),
                     _linear(m.attention_width, d, tp, b or m.sinks, False), _norm(m)]
        attention += [UnitSize(m.n_heads // tp, 1)] if m.sinks else []
    attention += [_norm(m), _norm(m)] if m.sandwich_norm else []
    return _sum(attention + ([router_and_shared(m)] if moe else _mlp(m, m.d_ff, tp, b)))


def router_and_shared(m: ModelShape) -> UnitSize:
    """What an MoE layer holds besides its routed experts: the router and the shared experts, whole on every tp rank."""
    shared = _mlp(m, m.n_shared_experts * m.expert_ff, 1, m.bias) if m.n_shared_experts else []
    return _sum([UnitSize((m.d_model + m.expert_biases) * m.n_experts, 1 + m.expert_biases)] + shared)


def expert_unit(m: ModelShape, ep: int, etp: int = 1) -> UnitSize:
    """The routed experts one rank holds of one MoE layer: n_experts / ep of them, stacked, each 1/etp of its hidden
    width (never split over the attention's tp: Megatron-core's expert tensor parallelism is its own) but for the
    down projection's bias, whole on every etp rank."""
    whole = m.d_model if m.expert_biases else 0
    return UnitSize(m.n_experts // ep * ((m.expert_params() - whole) // etp + whole),
                    (3 if m.gated_mlp else 2) * (1 + m.expert_biases))


def stage_blocks(workload: Workload, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, MoE) blocks on one rank of ``stage`` under the layout's split (:func:`stage_split`): the
    first ``n_dense_layers`` of the model are dense."""
    return rank_blocks(workload.model, stage_split(workload, layout), layout.pp, stage)


def embed_unit(m: ModelShape, tp: int) -> UnitSize:
    """Vocab-parallel token table plus the replicated learned positions."""
    positions = m.seq_len * m.d_model if m.learned_positions else 0
    return UnitSize(m.vocab_size * m.d_model // tp + positions, 2 if m.learned_positions else 1)


def head_unit(m: ModelShape, tp: int, pp: int = 1) -> UnitSize:
    """Vocab-parallel output projection without bias; nothing of its own when tied to the embedding on its rank
    (under pp the last stage holds a copy of the tied weight)."""
    return UnitSize(0, 0) if m.tied_embeddings and pp == 1 else UnitSize(m.d_model * m.vocab_size // tp, 1)


@functools.cache
def stage_units(m: ModelShape, tp: int, split: tuple[int, ...], pp: int, stage: int) -> tuple[tuple[UnitSize, int], ...]:
    """(unit, how many) one rank of ``stage`` holds under ``split``; cached since a search asks thousands of times."""
    first = ((embed_unit(m, tp), 1),) if stage == 0 else ()
    last = ((_norm(m), 1), (head_unit(m, tp, pp), 1)) if stage == pp - 1 else ()
    dense, moe = rank_blocks(m, split, pp, stage)
    blocks = ((block_unit(m, tp), dense),) if dense else ()
    blocks += ((block_unit(m, tp, moe=True), moe),) if moe else ()
    return blocks + first + last


def stage_expert_units(m: ModelShape, split: tuple[int, ...], pp: int, ep: int,
                       stage: int, etp: int = 1) -> tuple[tuple[UnitSize, int], ...]:
    """(routed experts of one MoE layer, how many layers) one rank of ``stage`` holds; empty for a dense
    model. The same at every tp: experts are whole on each tp rank (:func:`expert_unit`)."""
    moe = rank_blocks(m, split, pp, stage)[1]
    return ((expert_unit(m, ep, etp), moe),) if moe else ()


def largest_tensor(m: ModelShape, tp: int, ep: int, blocks: tuple[int, int], first: bool, last: bool) -> int:
    """Elements of the largest parameter tensor one tp rank of a stage holds (a gradient bucket holds at least
    one): the embedding or head on the end stages, else the widest block tensor."""
    dense, moe = blocks
    d, shared = m.d_model, m.n_shared_experts * m.expert_ff
    sizes = [d * m.qkv_width // tp]
    sizes += [(2 if m.gated_mlp else 1) * d * m.d_ff // tp] if dense else []
    sizes += [m.n_experts // ep * d * m.expert_ff, (2 if m.gated_mlp else 1) * d * shared] if moe else []
    sizes += [m.vocab_size * d // tp, m.seq_len * d if m.learned_positions else 0] if first else []
    sizes += [d * m.vocab_size // tp] if last else []  # a tied head's weight is the embedding's or a copy
    return max(sizes)


def params_per_tp_rank(m: ModelShape, tp: int) -> int:
    """Parameters per tp rank of the whole model (all stages, all experts)."""
    whole = (m.n_layers,)
    units = stage_units(m, tp, whole, 1, 0) + stage_expert_units(m, whole, 1, 1, 0)
    return sum(u.numel * n for u, n in units)


def active_params(m: ModelShape) -> int:
    """Parameters one token's forward uses: all of a dense model; of an MoE model, ``top_k`` of each MoE
    layer's ``n_experts`` routed experts (the shared ones always). FLOPs follow these, memory the total."""
    idle = (m.n_experts - m.top_k) * m.expert_params() if m.n_experts else 0
    return m.n_params() - (m.n_layers - m.n_dense_layers) * idle


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank of ``stage`` holds at its peak: model state, activations in flight, and transients
    (``buffers`` per :func:`buffer_bytes`, ``p2p`` its pipeline part, ``logits`` per :func:`logits_bytes`)."""

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
        """The larger transient peak: at the loss (logits plus p2p buffers) or in backward (every buffer)."""
        return max(self.buffers, self.p2p + self.logits)

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.transients


@functools.lru_cache(maxsize=4096)
def _model_state(
    workload: Workload, tp: int, split: tuple[int, ...], pp: int, dp: int, zero: int, stage: int, ep: int, edp: int,
    etp: int = 1) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of one rank: its units sharded over the ``dp`` ranks ZeRO shards over
    (padded to ceil(Psi_unit / dp)), routed experts over ``edp``, plus AdamW's step scalars. Cached."""
    b, m = workload.dtype_bytes, workload.model
    groups = ((stage_units(m, tp, split, pp, stage), dp), (stage_expert_units(m, split, pp, ep, stage, etp), edp))
    full = sum(u.numel * n for units, _ in groups for u, n in units)
    shard = sum(-(-u.numel // ranks) * n for units, ranks in groups for u, n in units)
    steps = STEP_SCALAR_BYTES * sum(u.tensors * n for units, _ in groups for u, n in units)
    params, grads, optimizer = sharded_state_bytes(full, shard, zero, b)
    return params, grads, optimizer + steps


def layer_activation_bytes(workload: Workload, layout: Layout, recompute: str | None = None, moe: bool = False) -> int:
    """Bytes one block keeps for backward per micro-batch, item by item from [KOR, sec. 4.1]: sbh(34 + 5as/h) (eq. 1),
    sbh(10 + 24/t + 5as/(ht)) under tp (eq. 2), sbh/t (34 + 5as/h) with sp (eq. 3), no 5as/h term under selective
    recomputation (eq. 6) or a fused kernel, 2sbh under full recomputation (sec. 5); MoE blocks add top_k expert copies
    and fp32 router outputs. Checked against measured bytes in tests/unit/test_plan_memory.py."""
    m, t, e = workload.model, layout.tp, workload.dtype_bytes.activation
    recompute = recompute or layout.recompute
    sbh = local_seq(workload, layout) * micro_batch_size(workload, layout) * m.d_model
    seq_split = t if layout.sequence_parallel else 1
    if recompute == "full":
        return e * sbh // seq_split
    # The two norms (:func:`norm_saved_bytes`) and the qkv and MLP inputs after them, dropout masks: only
    # sequence parallelism splits these.
    seq_sharded = 2 * (norm_saved_bytes(m, e) + e) * sbh + (2 * sbh if m.dropout else 0)
    # Q, K, V, the attention projection's input, a dense MLP's inner activations: split by heads or columns.
    qkv_and_proj_input = e * sbh * _attention_saved_width(m, expanded_kv=layout.cp == 1) // m.d_model
    width = (m.top_k + m.n_shared_experts) * m.expert_ff if moe else m.d_ff
    inner = (4 if m.gated_mlp else 2) * e * sbh * width // m.d_model
    router = 2 * max(e, DTYPE_BYTES["fp32"]) * sbh * m.n_experts // m.d_model
    experts = (3 * m.top_k * e * sbh + router + inner) // seq_split
    mlp_inner, routed = (0, experts) if moe else (inner, 0)
    scores = m.n_heads * workload.seq_len * sbh // m.d_model
    stores_scores = recompute == "none" and not m.flash_attention
    core = scores * (e + (1 + e if m.dropout else 0)) if stores_scores else 0
    return (seq_sharded // seq_split + routed + rotation_tables(workload, layout)
            + (qkv_and_proj_input + mlp_inner + core + cp_attention_output(workload, layout)) // t)


def rotation_tables(workload: Workload, layout: Layout) -> int:
    """RoPE cosines and sines, s x head_dim each in the activation dtype, saved by every block of the Llama
    family (``models.llama.Rotary``); 0 for learned positions."""
    m = workload.model
    if m.learned_positions:
        return 0
    width = m.qk_rope_head_dim if m.latent_attention else m.head_size
    return 2 * workload.dtype_bytes.activation * local_seq(workload, layout) * width


def norm_saved_bytes(m: ModelShape, e: int) -> int:
    """Bytes per feature and token one norm keeps for backward: a LayerNorm its input and statistics
    [KOR, 4.1]; an RMSNorm its fp32-widened input and normalized output (as measured in test_plan_memory.py)."""
    return e if m.bias else max(e, DTYPE_BYTES["fp32"]) + e


def _attention_saved_width(m: ModelShape, expanded_kv: bool) -> int:
    """Features per token attention saves split by heads: Q, K, V and the projection's input. Without cp
    (``expanded_kv``) K and V are repeated to every query head before SDPA, which saves the copies."""
    if not m.latent_attention:
        kv = 2 * m.attention_width if expanded_kv else m.qkv_width - m.attention_width
        return m.attention_width + kv + m.attention_width
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return m.n_heads * (2 * qk + 2 * v) + m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim


def cp_attention_output(workload: Workload, layout: Layout) -> int:
    """What cp attention keeps beside the projection's input (measured by ``bench.cp``): the ring its fp32 merged
    output and log-sum-exp, Ulysses the core's head-split output; 0 without cp."""
    if layout.cp == 1:
        return 0
    e = workload.dtype_bytes.activation
    tokens = local_seq(workload, layout) * micro_batch_size(workload, layout)
    if layout.cp_impl == "a2a":
        return e * tokens * workload.model.attention_width
    wide = max(e, DTYPE_BYTES["fp32"])
    return wide * tokens * (workload.model.attention_width + workload.model.n_heads)


def in_flight_chunks(layout: Layout, stage: int) -> int:
    """Micro-batch chunks ``stage`` holds at once: GPipe m, 1F1B min(p - stage, m), ZB-H1 min(p, m) [ZB, 3.1],
    interleaved 2(p - stage - 1) + (v - 1)p + 1 [NAR, 2.2.2; KOR, 4.2.2], as the simulator's
    ``Timeline.peak_activations``."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    return min(p if layout.schedule == "zb" else p - stage, m)


def _stage_extras(workload: Workload, layout: Layout, stage: int) -> tuple[int, int]:
    """(first, last): what one micro-batch saves outside the blocks on ``stage`` [KOR, sec. 4.3]: embedding
    dropout masks on stage 0, final norm and head inputs and fp32 logits on the last."""
    m, e, lay = workload.model, workload.dtype_bytes.activation, layout
    sbh = local_seq(workload, lay) * micro_batch_size(workload, lay) * m.d_model
    seq_split = lay.tp if lay.sequence_parallel else 1
    first = sbh // seq_split if stage == 0 and m.dropout else 0
    last = 2 * e * sbh // seq_split + 4 * sbh * m.vocab_size // (m.d_model * lay.tp) if stage == lay.pp - 1 else 0
    return first, last


def _stage_block_bytes(workload: Workload, layout: Layout, stage: int, recompute: str | None = None) -> int:
    """What all blocks of ``stage`` keep for one micro-batch: its dense and its MoE blocks."""
    dense, moe = stage_blocks(workload, layout, stage)
    return (dense * layer_activation_bytes(workload, layout, recompute)
            + (moe * layer_activation_bytes(workload, layout, recompute, moe=True) if moe else 0))


def _micro_batch_activation_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    first, last = _stage_extras(workload, layout, stage)
    return _stage_block_bytes(workload, layout, stage) + first + last


def _activation_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    """Peak activation bytes of one rank of ``stage`` [KOR, sec. 4.2-4.3]: blocks in flight times the per-block
    cost plus :func:`_stage_extras`, and one block's full activations under recomputation."""
    lay = layout
    chunks = in_flight_chunks(lay, stage)
    moe = stage_blocks(workload, lay, stage)[1] > 0
    working = (layer_activation_bytes(workload, lay, "none", moe) - layer_activation_bytes(workload, lay, None, moe)
               if lay.recompute != "none" else 0)
    first, last = _stage_extras(workload, lay, stage)
    total = chunks * (_stage_block_bytes(workload, lay, stage) // lay.virtual_stages) + working
    total += -(-chunks // lay.virtual_stages) * first
    return total + (lay.microbatches if lay.schedule == "gpipe" else 1) * last


def logits_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    """The logits alive while the last stage's loss runs (0 elsewhere): the head's output and its fp32 copy.
    Not saved for backward, so a transient for one micro-batch (:attr:`MemoryBreakdown.transients`)."""
    if stage != layout.pp - 1:
        return 0
    sbv = local_seq(workload, layout) * micro_batch_size(workload, layout) * workload.model.vocab_size // layout.tp
    copies = workload.dtype_bytes.activation + (0 if workload.precision == "fp32" else DTYPE_BYTES["fp32"])
    return copies * sbv


def buffer_bytes(workload: Workload, layout: Layout, stage: int) -> int:
    """Transient communication buffers: ZeRO-3's current and prefetched unit and one unit's gradient [ZeRO, 5.3],
    ZeRO-2's two buckets [ZeRO, 5.2 and 6.2 "CB"] (``zero.stage2_bucket_bytes``), a pipeline stage's
    :func:`p2p_bytes`."""
    b, m, lay = workload.dtype_bytes, workload.model, layout
    split = stage_split(workload, lay)
    units = stage_units(m, lay.tp, split, lay.pp, stage) + stage_expert_units(m, split, lay.pp, lay.ep, stage, lay.etp)
    largest = max(u.numel for u, _ in units)
    gathered = 2 * b.param * largest if layout.zero >= 3 else 0
    if layout.zero == 2:
        stage_elems = sum(u.numel * n for u, n in units)
        bucket_bytes = min(layout.bucket_bytes, b.grad * stage_elems // (2 * layout.shard_ranks))  # the runtime's cap
        tensor = largest_tensor(m, lay.tp, lay.ep, rank_blocks(m, split, lay.pp, stage), stage == 0,
                                stage == lay.pp - 1)
        buckets = max(2 * bucket_bytes // b.param, tensor)
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
    params, grads, optimizer = _model_state(workload, layout.tp, stage_split(workload, layout), layout.pp,
                                            layout.shard_ranks, layout.zero, stage, layout.ep,
                                            layout.expert_shard_ranks, layout.etp)
    acts = _activation_bytes(workload, layout, stage)
    return MemoryBreakdown(stage, params, grads, optimizer, acts, buffer_bytes(workload, layout, stage),
                           p2p_bytes(workload, layout), logits_bytes(workload, layout, stage))


def candidate_stages(workload: Workload, layout: Layout, stage: int | None = None) -> list[int]:
    """The stage asked for, or the only ones that can be worst: the first of each kind
    (:func:`~trainmesh.plan.stages.stage_kinds`), the first and the last stage among them."""
    if stage is not None:
        return [stage]
    return sorted(s for s, _ in stage_kinds(workload.model, stage_split(workload, layout), layout.pp))


def memory_per_rank(workload: Workload, layout: Layout, stage: int | None = None) -> MemoryBreakdown:
    """Memory of one rank of ``stage``, or of the worst stage when ``stage`` is None."""
    check_layout(workload, layout)
    return max((_stage_memory(workload, layout, s) for s in candidate_stages(workload, layout, stage)),
               key=lambda mb: mb.total)


def model_state_bytes(workload: Workload, layout: Layout, stage: int | None = None) -> int:
    """Parameters + gradients + optimizer state of one rank (worst stage when ``stage`` is None)."""
    check_layout(workload, layout)
    lay = layout
    split = stage_split(workload, lay)
    return max(sum(_model_state(workload, lay.tp, split, lay.pp, lay.shard_ranks, lay.zero, s, lay.ep,
                                lay.expert_shard_ranks, lay.etp))
               for s in candidate_stages(workload, lay, stage))


def activation_bytes(workload: Workload, layout: Layout, stage: int | None = None) -> int:
    """Peak activation bytes of one rank (worst stage when ``stage`` is None)."""
    check_layout(workload, layout)
    return max(_activation_bytes(workload, layout, s) for s in candidate_stages(workload, layout, stage))


def micro_batch_activation_bytes(workload: Workload, layout: Layout, stage: int | None = None) -> int:
    """Bytes one micro-batch's forward saves on one rank of ``stage`` (worst when None), as
    ``SavedActivations`` measures (``activation_bytes`` in metrics.jsonl); :func:`activation_bytes` is the peak."""
    check_layout(workload, layout)
    return max(_micro_batch_activation_bytes(workload, layout, s) for s in candidate_stages(workload, layout, stage))
