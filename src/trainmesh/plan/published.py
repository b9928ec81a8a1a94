"""Published production runs the step-time model is held to (docs/planner.md, "Production runs"), and the
planner's own choice beside each: layout, stated kernels (:class:`trainmesh.plan.Pricing`), figure and
allowed error."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from trainmesh.distributed.hardware import Cluster, make_cluster
from trainmesh.layout import Layout
from trainmesh.plan.presets import _llama_moe, model_shape
from trainmesh.plan.ranking import estimate
from trainmesh.plan.stages import fastest_split
from trainmesh.plan.timing import layer_seconds
from trainmesh.plan.workload import Pricing, Workload

# Qwen3-235B-A22B (Qwen3 technical report, 2025, and its config.json): 94 layers at 4096 wide, 64 query heads
# of 128, 4 key/value heads, q/k norms, 128 experts of 1536, top-8, vocabulary 151,936.
QWEN3_235B = dataclasses.replace(_llama_moe(94, 4096, 64, 4, 12288, 151936, experts=128, top_k=8, d_ff_expert=1536),
                                 head_dim=128, qk_norm=True)

# Megatron-LM, NeMo and Megatron-Bridge runs: Transformer Engine, whose fused attention on Hopper is cuDNN's
# (:data:`trainmesh.plan.kernels.ATTENTION`, "cudnn"). Llama 3 405B's rows take the default, FlashAttention-2 (the
# paper names no kernel; FlashAttention-3 came out after its training); DeepSeek-V3's FlashAttention-3, the fastest
# published Hopper curve (its report names no kernel either) (docs/planner.md, "Kernel curves").
TE = Pricing(attention_kernel="cudnn")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: ``metric`` "mfu" (bf16 MFU) or "tokens" (tokens/s per GPU), ``bound`` the relative error
    allowed, ``layout`` the published layout for the workload on the cluster."""

    name: str
    source: str
    moe: bool
    work: Workload
    gpu: str
    gpus: int
    build: Callable[[Workload, Cluster], Layout]
    published: float
    metric: str
    bound: float

    @property
    def cluster(self) -> Cluster:
        return make_cluster(self.gpu, self.gpus)

    def layout(self) -> Layout:
        return self.build(self.work, self.cluster)


def _split(base: Layout, chunks: int) -> Callable[[Workload, Cluster], Layout]:
    """The published layout ``base`` with the stage split the search takes for its ``chunks`` chunks."""
    def build(work: Workload, cluster: Cluster) -> Layout:
        flat = dataclasses.replace(base, pp=1, virtual_stages=1, schedule="1f1b", stage_layers=())
        return dataclasses.replace(base, stage_layers=fastest_split(*layer_seconds(work, flat, cluster), chunks))
    return build


def _fixed(layout: Layout) -> Callable[[Workload, Cluster], Layout]:
    return lambda work, cluster: layout


def _llama3(gpus: int, cp: int, dp: int, seq: int, per_dp: int, mfu: float) -> PublishedRun:
    """Llama 3 405B (Llama 3 Herd, 2024, Table 4 and 3.3.2): TP8, PP16 with one block fewer on the end stages, bf16, no
    recomputation. Set here: v = 7 (the deepest the runtime runs), ZeRO-1, sequence parallelism."""
    work = Workload(model_shape("llama3-405b"), dp * per_dp, seq, "bf16")
    base = Layout(dp=dp, tp=8, pp=16, cp=cp, zero=1, microbatches=per_dp, schedule="interleaved", virtual_stages=7,
                  sequence_parallel=True)
    label = f"Llama 3 405B, {seq // 1024}K, {gpus:,} H100"
    return PublishedRun(label, "Llama 3 Herd of Models, Table 4", False, work, "h100-80gb", gpus, _split(base, 16 * 7),
                        mfu, "mfu", 0.10)


# DeepSeek-V3's stated kernels (the report, 3.2-3.3), with the attention kernel set as above.
DEEPSEEK_V3 = Pricing(a2a_overlap=True, dispatch_dtype="fp8", comm_sm_share=20 / 132, fp8_experts=True,
                      forward_dispatch=True, attention_kernel="fa3")


def _qwen3_30b_work() -> Workload:
    """Qwen3-30B-A3B on Megatron-Bridge's DGX-H100 recipe: FP8 current scaling with the experts in FP8,
    sequence 4096, batch 1024, HybridEP's forwarding dispatch, Transformer Engine's attention."""
    return Workload(model_shape("qwen3-30b-a3b"), 1024, 4096, "fp8",
                    pricing=dataclasses.replace(TE, fp8_experts=True, forward_dispatch=True))


PUBLISHED: tuple[PublishedRun, ...] = (
    _llama3(8192, 1, 64, 8192, 32, 0.43),
    _llama3(16384, 1, 128, 8192, 16, 0.41),
    _llama3(16384, 16, 8, 131072, 16, 0.38),
    # Megatron-Bridge performance summary, NeMo 25.11, DGX-H100: FSDP over 8 GPUs, FP8 per-tensor current
    # scaling, sequence 8192, batch 128, micro-batch 1: 14,451 tokens/s per GPU (14,079 in 25.09).
    PublishedRun("Llama 3 8B FP8, 8 H100", "Megatron-Bridge performance summary, 25.11", False,
                 Workload(model_shape("llama3-8b"), 128, 8192, "fp8", pricing=TE), "h100-80gb", 8,
                 _fixed(Layout(dp=8, zero=3, microbatches=16)), 14451, "tokens", 0.10),
    # DeepSeek-V3 report (arXiv 2412.19437, 2.1.2, 3.1-3.3): 2048 H800, PP16 under DualPipe (priced as ZB-H1),
    # EP64, ZeRO-1, FP8 with FP8 experts, FP8 dispatch and bf16 combine, 20 of 132 SMs communicating,
    # node-limited routing with a forwarding dispatch; 180K H800 hours per trillion tokens. Set here: no
    # recomputation.
    PublishedRun("DeepSeek-V3, 2,048 H800", "DeepSeek-V3 technical report, 3.1-3.3", True,
                 Workload(model_shape("deepseek-v3"), 15360, 4096, "fp8",
                          pricing=DEEPSEEK_V3),
                 "h800-80gb", 2048, _split(Layout(dp=128, pp=16, ep=64, zero=1, microbatches=120, schedule="zb"), 16),
                 1543, "tokens", 0.15),
    # Megatron-Bridge performance summary (26.04: 8,901; 26.04.01: 8,960; 26.06: 8,826), TP1 PP1 EP16 on two
    # DGX-H100 nodes, routing forced to balance, no recomputation, micro-batch 1.
    PublishedRun("Qwen3-30B-A3B FP8, EP16, 16 H100", "Megatron-Bridge performance summary, 26.04", True,
                 _qwen3_30b_work(), "h100-80gb", 16, _fixed(Layout(dp=16, ep=16, zero=1, microbatches=64)),
                 8900, "tokens", 0.15),
    # The same model and batch at TP1 PP2 (v = 12) EP8 on one node: 9,058 (26.02.01).
    PublishedRun("Qwen3-30B-A3B FP8, PP2 EP8, 16 H100", "Megatron-Bridge performance summary, 26.02.01", True,
                 _qwen3_30b_work(), "h100-80gb", 16,
                 _split(Layout(dp=8, pp=2, ep=8, zero=1, microbatches=128, schedule="interleaved", virtual_stages=12), 24),
                 9058, "tokens", 0.15),
    # GPT-OSS 120B, bf16, TP1 PP4 EP8 on 64 H100, batch 1280: 5,810 to 5,993 (26.02 to 26.04.01). Its recompute
    # of norms and activations is element-wise and not priced; the stages split evenly (9 blocks each).
    PublishedRun("GPT-OSS 120B, PP4 EP8, 64 H100", "Megatron-Bridge performance summary, 26.04", True,
                 Workload(model_shape("gpt-oss-120b"), 1280, 4096, "bf16", pricing=TE), "h100-80gb", 64,
                 _fixed(Layout(dp=16, pp=4, ep=8, zero=1, microbatches=80)), 5900, "tokens", 0.15),
    # Megatron-Core MoE best practice (yanring/Megatron-MoE-ModelZoo, best_practice/Qwen3): Qwen3-235B-A22B,
    # bf16, 256 H100, sequence 4096, batch 2048, TP4 EP8 PP8 (v = 4) DP8 under sequence parallelism, no
    # recomputation, forced balance, DeepEP's dispatcher: 29.0 s a step, 1,130 tokens/s per GPU; ep folded over
    # tp on one node.
    PublishedRun("Qwen3-235B-A22B, TP4 EP8 PP8, 256 H100", "Megatron-MoE-ModelZoo best practice", True,
                 Workload(QWEN3_235B, 2048, 4096, "bf16", pricing=dataclasses.replace(TE, forward_dispatch=True)),
                 "h100-80gb", 256,
                 _split(Layout(dp=8, tp=4, pp=8, ep=8, zero=1, microbatches=256, schedule="interleaved",
                               virtual_stages=4, sequence_parallel=True), 32),
                 1130, "tokens", 0.15),
)

def predicted(run: PublishedRun) -> float:
    """The planner's figure for ``run`` in the unit the source reports."""
    estimated = estimate(run.work, run.layout(), run.cluster)
    return estimated.mfu if run.metric == "mfu" else estimated.tokens_per_s / run.gpus


def error(run: PublishedRun) -> float:
    """The planner's relative error on ``run``: predicted / published - 1."""
    return predicted(run) / run.published - 1


@dataclass(frozen=True)
class Beside:
    """The planner's own choice next to a published recipe: each layout with its predicted figure (in the
    source's unit) and memory per rank on its worst stage, and why the planner takes its own."""

    run: PublishedRun
    published_layout: Layout
    published_figure: float
    published_gib: float
    own_layout: Layout
    own_figure: float
    own_gib: float
    reason: str


def beside_published(run: PublishedRun) -> Beside:
    """Search ``run``'s workload as ``trainmesh plan`` does and set the chosen layout beside the published one, naming
    what decided it: the published one not fitting the planner's memory, or which parts of the step the choice
    shortens."""
    from trainmesh.plan.ranking import best_layout

    cluster, mine = run.cluster, run.layout()
    theirs = estimate(run.work, mine, cluster)
    own = estimate(run.work, best_layout(run.work, cluster), cluster)

    def figure(e: object) -> float:
        return e.mfu if run.metric == "mfu" else e.tokens_per_s / run.gpus  # type: ignore[attr-defined]

    gib = 2**30
    usable = cluster.usable_bytes / gib
    if own.layout == mine:
        reason = "the planner chooses the published layout"
    elif theirs.memory.total > cluster.usable_bytes:
        reason = (f"the published layout needs {theirs.memory.total / gib:.1f} GiB per rank in trainmesh, above the "
                  f"{usable:.1f} GiB usable (activations {theirs.memory.activations / gib:.1f} GiB: trainmesh's modules "
                  f"keep more than fused kernels); the planner's fits in {own.memory.total / gib:.1f} GiB")
    else:
        parts = ("compute", "dp_comm", "tp_comm", "pp_comm", "bubble", "cp_comm", "ep_comm")
        saved = sorted(((getattr(theirs.time, p) - getattr(own.time, p), p) for p in parts), reverse=True)
        named = ", ".join(f"{p} {s:.2f} s" for s, p in saved if s > 0.005 * theirs.time.total)
        faster = theirs.time.total / own.time.total - 1
        reason = (f"predicted {faster:+.1%} faster a step ({theirs.time.total:.2f} -> {own.time.total:.2f} s), "
                  f"saving {named or 'nothing beyond the tie tolerance'}")
    return Beside(run, mine, figure(theirs), theirs.memory.total / gib, own.layout, figure(own),
                  own.memory.total / gib, reason)


def format_beside(b: Beside) -> str:
    """Two lines and a reason: the published layout and the planner's, each with its predicted figure."""
    unit = "MFU" if b.run.metric == "mfu" else "tokens/s/GPU"
    shown = (lambda v: f"{v:.1%}") if b.run.metric == "mfu" else (lambda v: f"{v:,.0f}")
    return (f"{b.run.name} (published {shown(b.run.published)} {unit})\n"
            f"  published: {_short(b.published_layout)}"
            f": {shown(b.published_figure)}, {b.published_gib:.1f} GiB/rank\n"
            f"  planner:   {_short(b.own_layout)}"
            f": {shown(b.own_figure)}, {b.own_gib:.1f} GiB/rank\n"
            f"  why: {b.reason}")


def _short(layout: Layout) -> str:
    """The layout's fields that differ from :class:`Layout`'s defaults, as ``name=value``."""
    default = Layout()
    shown = [f"{f.name}={getattr(layout, f.name)}" for f in dataclasses.fields(Layout)
             if f.name not in ("stage_layers", "precision") and getattr(layout, f.name) != getattr(default, f.name)]
    return " ".join(shown)


def format_published() -> str:
    """Every published run: its figure, the planner's, the error against the bound it is held to, and the planner's own
    layout beside the published one (:func:`format_beside`)."""
    blocks = []
    for run in PUBLISHED:
        err = error(run)
        held = "within" if abs(err) <= run.bound else "OUTSIDE"
        blocks.append(f"{format_beside(beside_published(run))}\n  error {err:+.1%}, {held} the {run.bound:.0%} it is "
                      f"held to ({run.source})")
    return "\n".join(blocks)
