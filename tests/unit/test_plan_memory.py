"""The planner's memory against what trainmesh's modules save, and at the layouts published runs used.

A block's saved activations are measured with :class:`trainmesh.tracking.metrics.SavedActivations` on one block of
each family at a tiny size (CPU, no ranks) and held to the planner's count. The published layouts are
priced as their sources describe them; docs/planner.md gives the figures per component."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainmesh.distributed.hardware import make_cluster
from trainmesh.tracking.metrics import SavedActivations
from trainmesh.models import preset, spec_of
from trainmesh.plan import Layout, Workload, layer_activation_bytes, memory_per_rank, model_shape
from trainmesh.plan.memory import buffer_bytes, p2p_bytes

LLAMA3_SPLIT = (7,) + (8,) * 14 + (7,)


def llama3_405b(cp: int, dp: int, seq: int, per_dp: int, recompute: str = "none") -> tuple[Workload, Layout]:
    """Llama 3 405B as "The Llama 3 Herd of Models" (2024), 3.3.2 and Table 4, runs it: TP8 with sequence
    parallelism, PP16 split 7, 8 x 14, 7 (one block fewer on the stages holding the embedding and the head),
    micro-batches of one sequence, bf16 with fp32 gradients, optimizer states and gradients sharded over
    dp (ZeRO-2), no activation checkpointing."""
    work = Workload(model_shape("llama3-405b"), dp * per_dp, seq, "bf16")
    return work, Layout(dp=dp, tp=8, pp=16, cp=cp, zero=2, microbatches=per_dp, sequence_parallel=True,
                        stage_layers=LLAMA3_SPLIT, recompute=recompute)


def deepseek_v3(recompute: str = "none") -> tuple[Workload, Layout]:
    """DeepSeek-V3 as its technical report (arXiv 2412.19437, 3.2-3.4) trains it: 2048 GPUs, PP16 (DualPipe,
    priced as zero bubble's ZB-H1, whose activations match DualPipe's PP + 1 micro-batches within one), EP64,
    ZeRO-1 over dp128, FP8 linears, sequence 4096, batch 15360 in micro-batches of one; the runtime's
    parameter-balanced stage split."""
    work = Workload(model_shape("deepseek-v3"), 15360, 4096, "fp8")
    return work, Layout(dp=128, pp=16, ep=64, zero=1, microbatches=120, schedule="zb", recompute=recompute)


PUBLISHED = {"llama3-405b-8k": (llama3_405b, (1, 64, 8192, 32), "h100-80gb"),
             "llama3-405b-128k": (llama3_405b, (16, 8, 131072, 16), "h100-80gb"),
             "deepseek-v3": (deepseek_v3, (), "h800-80gb")}


@pytest.mark.parametrize("name,block,precision", [("llama-tiny", "0", "bf16"), ("llama-tiny", "0", "fp32"),
                                                  ("llama-moe-tiny", "1", "bf16"), ("tiny", "0", "bf16")])
def test_a_blocks_saved_activations_are_what_the_planner_counts(name: str, block: str, precision: str) -> None:
    """RMSNorm's fp32 copy and normalized output, grouped-query K and V repeated to every head, the
    rotation's tables, an MoE layer's expert outputs in expert and in token order and its fp32 router: each
    counted, the planner is within 2 % of what one block 256 wide saves. What it leaves out is per token
    (norm statistics, the attention's log-sum-exp, routing indices): 0.3 % of this llama block, 0.9 % of
    this MoE one, less in wider models."""
    torch.manual_seed(0)
    spec = spec_of(name)
    cfg = dataclasses.replace(preset(name), d_model=256)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model, shape = spec.builder(cfg).to(dtype), spec.shape(cfg)
    seq = min(cfg.seq_len, 64)
    x = torch.randn(1, seq, shape.d_model, dtype=dtype, requires_grad=True)
    saved = SavedActivations(list(model.parameters()))
    with saved.recording():
        model.blocks[block](x)
    moe = shape.n_experts > 0 and int(block) >= shape.n_dense_layers
    predicted = layer_activation_bytes(Workload(shape, 1, seq, precision), Layout(), moe=moe)
    assert predicted <= saved.bytes <= 1.02 * predicted


def test_zero2_buckets_of_a_middle_stage_hold_its_widest_tensor_not_the_heads() -> None:
    """A gradient bucket holds at least one tensor: on Llama 3 405B's stage 1 the fused gate and up
    projection (2 x 16384 x 53248 / tp), not the vocabulary-wide head that only the last stage holds."""
    work, layout = llama3_405b(1, 64, 8192, 32)
    m = work.model
    gate_up = 2 * m.d_model * m.d_ff // layout.tp
    assert buffer_bytes(work, layout, 1) == work.dtype_bytes.grad * gate_up + p2p_bytes(work, layout)
    assert buffer_bytes(work, layout, 15) > buffer_bytes(work, layout, 1)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_layouts_fit_in_80_gib_with_full_recomputation(name: str) -> None:
    """The published parallelism holds the model state: each layout fits on its 80 GiB GPUs once trainmesh
    keeps only each block's input (``--recompute full``). Without it trainmesh's modules keep more than
    the published runs' fused kernels did (docs/planner.md, "Memory of published layouts")."""
    build, args, gpu = PUBLISHED[name]
    work, layout = build(*args, recompute="full")
    assert memory_per_rank(work, layout).total <= make_cluster(gpu, layout.world).usable_bytes


def test_llama3_405b_without_model_parallelism_does_not_fit() -> None:
    work, layout = llama3_405b(1, 64, 8192, 32)
    unsplit = dataclasses.replace(layout, tp=1, pp=1, dp=8192, microbatches=1, sequence_parallel=False,
                                  stage_layers=())
    work = dataclasses.replace(work, global_batch=8192)
    assert memory_per_rank(work, unsplit).total > make_cluster("h100-80gb", 8192).usable_bytes
