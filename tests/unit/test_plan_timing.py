"""The step-time model's precision and overlap: FP8 block linears at the FP8 peak, everything else at the
16-bit one, and the expert all-to-all hidden behind a paired micro-batch's compute where the schedule
pairs them (DualPipe)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainmesh.layout import LayoutError
from trainmesh.models import ModelShape
from trainmesh.plan import (Cluster, Layout, Pricing, Workload, block_gemms, check_layout, make_cluster, model_shape,
                            model_state_bytes, step_time)
from trainmesh.plan.ranking import ep_degrees, interleave_depths
from trainmesh.plan.dp_traffic import all_reduce_time
from trainmesh.plan.kernels import deepep_shares
from trainmesh.plan.timing import (all_to_all_seconds, block_elementwise_bytes, block_seconds, expert_elementwise_bytes,
                                   gemm_time, head_seconds, nodes_per_token, routed_copy_bytes, token_movement_bytes)


@pytest.mark.parametrize("gpu,speedup", [("h100-80gb", 1979 / 989), ("h800-80gb", 1979 / 989), ("a100-80gb", 1.0)])
@pytest.mark.parametrize("fp8_experts", [False, True])
def test_fp8_runs_the_block_linears_at_the_fp8_peak_and_the_core_router_head_and_grouped_experts_in_bf16(
        gpu: str, speedup: float, fp8_experts: bool) -> None:
    """H100/H800 double the dense rate in FP8 (1979 vs 989 TFLOP/s); an A100 has no FP8 tensor cores, so
    an fp8 plan for it is no faster than bf16. The routed experts are trainmesh's grouped matmuls, which stay
    bf16 under fp8 (torchao converts ``nn.Linear`` only; the shared experts are one); a published run whose
    experts multiply in FP8 says so with ``fp8_experts``."""
    shape, cluster, layout = model_shape("deepseek-v3"), make_cluster(gpu, 8), Layout(dp=8, ep=8)
    pricing = Pricing(fp8_experts=fp8_experts)
    fp8, bf16 = Workload(shape, 8, 4096, "fp8", pricing=pricing), Workload(shape, 8, 4096, "bf16", pricing=pricing)
    for name, gemm in block_gemms(bf16, layout, moe=True).items():
        ratio = gemm_time(gemm, bf16, cluster) / gemm_time(gemm, fp8, cluster)
        in_bf16 = name in ("attention", "router") or (name.startswith("experts") and not fp8_experts)
        assert ratio == pytest.approx(1.0 if in_bf16 else speedup, rel=1e-12), name
    assert head_seconds(fp8, layout, cluster) == head_seconds(bf16, layout, cluster)


def test_fp8_with_tensor_parallelism_is_priced_as_fp8_plus_its_amax_all_reduces() -> None:
    """Each float8 tp linear all-reduces its amaxes (16 bytes) once forward and once backward: 8 a dense block."""
    cluster, layout = make_cluster("h100-80gb", 8), Layout(dp=4, tp=2, sequence_parallel=True)
    fp8, bf16 = (Workload(model_shape("llama3-8b"), 8, 4096, p) for p in ("fp8", "bf16"))
    check_layout(fp8, layout)
    extra = step_time(fp8, layout, cluster).tp_comm - step_time(bf16, layout, cluster).tp_comm
    assert extra == pytest.approx(8 * 32 * all_reduce_time(16, 2, cluster.link(2)), rel=1e-9)


def _moe() -> ModelShape:
    return ModelShape(4, 256, 4, 704, 256, 512, gated_mlp=True, bias=False, learned_positions=False,
                      n_kv_heads=2, n_experts=8, top_k=2, d_ff_expert=192)


@pytest.mark.parametrize("link_gbps", [1.0, 1000.0])
def test_paired_micro_batches_hide_the_all_to_all_up_to_their_compute(link_gbps: float) -> None:
    """Exposed ep time is max(0, a2a - compute) per micro-batch: on a slow link what exceeds the compute,
    on a fast one nothing; the rest of the step is unchanged."""
    work, cluster = Workload(_moe(), 16, 512, "bf16"), make_cluster("h100-80gb", 4, intra_gbps=link_gbps)
    plain = step_time(work, Layout(dp=4, ep=4, microbatches=2), cluster)
    paired = step_time(dataclasses.replace(work, pricing=Pricing(a2a_overlap=True)), Layout(dp=4, ep=4, microbatches=2),
                       cluster)
    assert plain.ep_comm > 0
    assert paired.ep_comm == pytest.approx(max(0.0, plain.ep_comm - plain.compute), rel=1e-12)
    assert dataclasses.replace(paired, ep_comm=0) == dataclasses.replace(plain, ep_comm=0)


def test_under_sequence_parallelism_ep_folds_over_tp_inside_a_node() -> None:
    """tp4 x dp8 on 4 nodes: without SP, ep8 takes 8 dp ranks 4 apart, a group over 4 nodes (32 ranks), its
    all-to-all over InfiniBand; under SP it takes two whole tp groups, 8 consecutive ranks on one node, at
    NVLink's pace, and the search offers ep up to tp x dp (32). The experts are no longer the same on the tp
    ranks: ZeRO shards them over the dp x tp / ep = 4 ranks holding the same ones, and their gradients need
    no sum over tp."""
    work, cluster = Workload(_moe(), 32, 512, "bf16"), make_cluster("h100-80gb", 32)
    spread = Layout(dp=8, tp=4, ep=8, zero=1, microbatches=4)
    folded = dataclasses.replace(spread, sequence_parallel=True)
    assert (spread.ep_span, folded.ep_span) == (32, 8)
    assert (spread.expert_shard_ranks, folded.expert_shard_ranks) == (1, 4)
    intra, inter = cluster.link(8), cluster.link(32)
    assert intra[0] > inter[0]
    assert all_to_all_seconds(work, folded, cluster, 2) < all_to_all_seconds(work, spread, cluster, 2) / 2
    assert (spread.token_ranks, folded.token_ranks) == (8, 32)
    assert ep_degrees(dataclasses.replace(work.model, n_experts=32), folded.token_ranks)[-1] == 32
    with pytest.raises(LayoutError, match="set sequence_parallel=True so that ep folds over tp too"):
        check_layout(work, dataclasses.replace(spread, ep=16, dp=4, microbatches=8))


def _deepseek(**pricing: object) -> tuple[Workload, Layout, Cluster]:
    """DeepSeek-V3 at EP64 over 8 H800 nodes, the latencies zeroed so that only the bytes count."""
    cluster = dataclasses.replace(make_cluster("h800-80gb", 64), intra_latency=0.0, inter_latency=0.0)
    work = Workload(model_shape("deepseek-v3"), 64, 4096, "bf16", pricing=Pricing(**pricing))
    return work, Layout(dp=64, ep=64), cluster


def _priced(work: Workload, **pricing: object) -> Workload:
    return dataclasses.replace(work, pricing=dataclasses.replace(work.pricing, **pricing))


def test_a_forwarded_dispatch_crosses_to_each_node_of_a_token_once() -> None:
    """DeepSeek-V3 picks its 8 experts within 4 of 8 groups, a group per node: forwarded, each token crosses
    InfiniBand once to each of its 4 nodes (7/8 of them others), where sent straight 7/8 of its 8 copies do;
    NVLink forwards it. The forwarded dispatch runs at DeepEP's measured 51 GB/s of a 50 GB/s NIC at EP64, the
    straight one at NCCL's 70 %. Without the group limit a token's 8 of 256 experts fall on 8 (1 - C(224, 8) /
    C(256, 8)) = 5.3 of the 8 nodes."""
    work, layout, cluster = _deepseek()
    forwarded = _priced(work, forward_dispatch=True)
    straight = all_to_all_seconds(work, layout, cluster, 2)
    ratio = all_to_all_seconds(forwarded, layout, cluster, 2) / straight
    assert ratio == pytest.approx((4 * 7 / 8 / 8) / (7 / 8) * cluster.comm_efficiency / (51 / 50))
    free = dataclasses.replace(forwarded, model=dataclasses.replace(work.model, expert_groups=0, groups_per_token=0))
    assert nodes_per_token(work.model, 8) == 4 and nodes_per_token(work.model, 16) == 8
    assert nodes_per_token(free.model, 8) == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert all_to_all_seconds(free, layout, cluster, 2) / all_to_all_seconds(forwarded, layout, cluster, 2) == (
        pytest.approx(nodes_per_token(free.model, 8) / 4))


def test_an_all_to_all_over_two_nodes_moves_its_node_s_share_over_nvlink_beside_the_nic() -> None:
    """EP16 over two H100 nodes, sent straight: half of a rank's copies cross the NIC while 7/16 go to the
    other ranks of its node over NVLink at the same time, so the NIC's half sets the pace, not 15/16 of the
    copies at the NIC's."""
    cluster = dataclasses.replace(make_cluster("h100-80gb", 16), intra_latency=0.0, inter_latency=0.0)
    work, layout = Workload(model_shape("qwen3-30b-a3b"), 16, 4096, "bf16"), Layout(dp=16, ep=16)
    copies = routed_copy_bytes(work, layout, 2)
    (inter, _), (intra, _) = cluster.link(16), cluster.link(8)
    assert copies * 7 / 16 / intra < copies / 2 / inter
    assert all_to_all_seconds(work, layout, cluster, 2) == pytest.approx(copies / 2 / inter, rel=1e-12)


def test_deepeps_kernels_run_each_link_at_their_measured_share() -> None:
    """A forwarded dispatch and combine at DeepEP's normal kernels' bandwidths [DeepEP README, H800]: within a node
    of 8 at 153 and 158 of the H800's 200 GB/s of NVLink, across nodes by ep at 43 (EP16) to 58 (EP32) GB/s of the
    NIC's 50, flat beyond; a dispatch sent straight keeps the link model."""
    assert deepep_shares(16, False) == (43 / 50, 153 / 200) and deepep_shares(64, True) == (50 / 50, 158 / 200)
    assert deepep_shares(32, True)[0] == 57 / 50
    assert deepep_shares(8, False)[0] == 43 / 50 and deepep_shares(128, True)[0] == 50 / 50
    cluster = dataclasses.replace(make_cluster("h100-80gb", 8), intra_latency=0.0)
    work, layout = Workload(model_shape("qwen3-30b-a3b"), 8, 4096, "bf16"), Layout(dp=8, ep=8)
    copies = routed_copy_bytes(work, layout, 2)
    forwarded = _priced(work, forward_dispatch=True)
    for combine, share in ((False, 153 / 200), (True, 158 / 200)):
        seconds = all_to_all_seconds(forwarded, layout, cluster, 2, combine)
        assert seconds == pytest.approx(copies * 7 / 8 / (cluster.intra_bw * share), rel=1e-12)
    assert all_to_all_seconds(work, layout, cluster, 2) == pytest.approx(copies * 7 / 8 / cluster.link(8)[0], rel=1e-12)


def test_an_fp8_dispatch_halves_the_bytes_towards_the_experts_only() -> None:
    """Dispatch in FP8, combine in bf16 [DSV3, 3.3.3]: 1 + 2 bytes per element of the two directions, not 2 + 2."""
    work, layout, cluster = _deepseek()
    bf16 = step_time(work, layout, cluster).ep_comm
    assert step_time(_priced(work, dispatch_dtype="fp8"), layout, cluster).ep_comm == pytest.approx(
        bf16 * 3 / 4, rel=1e-12)


def test_compute_runs_on_what_the_communication_kernels_leave() -> None:
    """20 of 132 SMs serving communication leave compute 112 / 132 of the device [DSV3, 3.2.2]."""
    work, layout, cluster = _deepseek()
    shared = step_time(_priced(work, comm_sm_share=20 / 132), layout, cluster)
    assert shared.compute == pytest.approx(step_time(work, layout, cluster).compute * 132 / 112, rel=1e-12)
    with pytest.raises(ValueError, match="comm_sm_share=1"):
        Pricing(comm_sm_share=1)


def test_deepseek_moves_1_3_mb_a_token_through_each_moe_layer_at_ep64_with_an_fp8_dispatch() -> None:
    """Counted by hand from the movements named in :func:`token_movement_bytes` (d = 7168, k = 8, 256
    experts): router 3 x 256 x 4; towards the experts, FP8, gathered then sorted after the all-to-all,
    2 x 2 k d x 1, forward and backward alike; back, bf16, the unsort 2 k d x 2 both ways, the weighted sum
    (k + 1) d x 2 forward and (2k + 1) d x 2 backward."""
    work, layout, _ = _deepseek(dispatch_dtype="fp8")
    towards, unsort = 2 * 2 * 8 * 7168 * 1, 2 * 8 * 7168 * 2
    per_token = 3 * 256 * 4 + 2 * (towards + unsort) + 9 * 7168 * 2 + 17 * 7168 * 2
    assert per_token == 1_293_312
    assert token_movement_bytes(work, layout) == 4096 * per_token


def test_a_block_streams_its_element_wise_work_and_an_moe_block_its_token_movement_at_the_memory_bandwidth() -> None:
    work, layout, cluster = _deepseek()
    unpriced = dataclasses.replace(cluster, memory_bw=0.0)
    moved = block_seconds(work, layout, cluster, moe=True) - block_seconds(work, layout, unpriced, moe=True)
    streamed = (token_movement_bytes(work, layout) + expert_elementwise_bytes(work, layout, cluster)
                + block_elementwise_bytes(work, layout, moe=True))
    assert moved == pytest.approx(streamed / (3.35e12 * 0.85), rel=1e-12)
    # the experts' SwiGLU, 8 f elements of bf16 a copy (d_ff_expert 2048, top-8, 4096 tokens)
    assert expert_elementwise_bytes(work, layout, cluster) == 4096 * 8 * 8 * 2048 * 2
    dense = block_seconds(work, layout, cluster) - block_seconds(work, layout, unpriced)
    assert dense == pytest.approx(block_elementwise_bytes(work, layout) / (3.35e12 * 0.85), rel=1e-12)


def test_the_element_wise_bytes_of_a_llama_block_counted_by_hand() -> None:
    """Llama 3 8B (d 4096, 32 + 8 heads of 128, SwiGLU 14336), 8192 tokens, tp 1: two norms (2 + 3 elements of d
    each) and two residual adds (3 + 3), rotary on 40 heads (2 + 2), SwiGLU (3 + 5 of f), 2 bytes each; under fp8
    each linear's input and output gradient cast at 4 bytes an element; under full recomputation the forward's
    counts twice; tp 2 with sequence parallelism halves every count."""
    work, layout = Workload(model_shape("llama3-8b"), 8, 8192, "bf16"), Layout(dp=8, microbatches=1)
    d, heads, f = 4096, 40 * 128, 14336
    per_token = (2 * 5 + 2 * 6) * d + 4 * heads + 8 * f
    assert block_elementwise_bytes(work, layout) == 8192 * per_token * 2
    fp8 = dataclasses.replace(work, precision="fp8")
    casts = (d + 48 * 128) + (32 * 128 + d) + (d + 2 * f) + (f + d)
    assert block_elementwise_bytes(fp8, layout) == 8192 * (per_token * 2 + 4 * casts)
    rerun = (2 * 2 + 2 * 3) * d + 2 * heads + 3 * f
    full = dataclasses.replace(layout, recompute="full")
    assert block_elementwise_bytes(work, full) == 8192 * (per_token + rerun) * 2
    split = Layout(dp=8, tp=2, microbatches=1, sequence_parallel=True)
    assert block_elementwise_bytes(work, split) == 8192 * per_token * 2 / 2


def test_finer_experts_at_the_same_flops_move_about_twice_the_bytes() -> None:
    """Twice the experts, each half as wide, a token to twice as many: the expert matmuls' FLOPs are the same,
    the copies that travel to them twice as many, so the movement's share of the block grows."""
    coarse = Workload(_moe(), 16, 512, "bf16")
    fine = dataclasses.replace(coarse, model=dataclasses.replace(_moe(), n_experts=16, top_k=4, d_ff_expert=96))
    layout, cluster = Layout(dp=4, ep=4, microbatches=2), make_cluster("h100-80gb", 4)
    flops = [sum(g.flops for name, g in block_gemms(w, layout, moe=True).items() if name.startswith("experts"))
             for w in (coarse, fine)]
    assert flops[0] == flops[1]
    ratio = token_movement_bytes(fine, layout) / token_movement_bytes(coarse, layout)
    assert 1.8 < ratio < 2.0
    shares = [token_movement_bytes(w, layout) / cluster.memory_bw / block_seconds(w, layout, cluster, moe=True)
              for w in (coarse, fine)]
    assert shares[1] > shares[0]


def test_small_matmuls_are_priced_at_each_devices_own_ridge_point() -> None:
    """The fit's half dimension (160 on the A100-80GB, whose ridge is 312 / 2.04 = 153) follows peak / HBM
    bandwidth: an H100's 989 / 3.35 puts it near 309, so a head_dim-wide matmul reaches less of its peak."""
    half = {gpu: make_cluster(gpu, 8).gemm_half_dim for gpu in ("a100-80gb", "h100-80gb", "h800-80gb", "h200-141gb")}
    assert half["a100-80gb"] == 160
    assert half["h100-80gb"] == half["h800-80gb"] == round(160 * (989 / 3.35) / (312 / 2.039))
    assert half["a100-80gb"] < half["h200-141gb"] < half["h100-80gb"]


@pytest.mark.parametrize("pp,layers,depths", [(16, 126, [2, 4, 7]), (2, 126, [2, 4, 8]), (16, 48, [2, 3]),
                                              (64, 126, [])])
def test_the_search_interleaves_up_to_the_deepest_split_the_runtime_runs(pp: int, layers: int,
                                                                        depths: list[int]) -> None:
    assert interleave_depths(pp, layers) == depths


def test_expert_tensor_parallelism_splits_the_experts_weights_keeps_their_flops_and_pays_its_gathers() -> None:
    """etp2 over ep2: each rank holds half of each of its experts (as much as at ep4) and multiplies twice the copies
    at half the width (the same expert flops); each all-to-all round adds the etp gather of the copies and the sum of the outputs."""
    work, cluster = Workload(_moe(), 16, 512, "bf16"), make_cluster("h100-80gb", 4)
    ep, etp = Layout(dp=4, ep=2), Layout(dp=4, ep=2, etp=2)
    whole, split = block_gemms(work, ep, moe=True)["experts_in"], block_gemms(work, etp, moe=True)["experts_in"]
    assert split.flops == whole.flops and split.dims == (2 * whole.dims[0], whole.dims[1], whole.dims[2] // 2)
    assert model_state_bytes(work, etp) == model_state_bytes(work, Layout(dp=4, ep=4)) < model_state_bytes(work, ep)
    assert step_time(work, etp, cluster).ep_comm > step_time(work, ep, cluster).ep_comm
