"""Context parallelism without processes: the ring's blockwise arithmetic against one
``scaled_dot_product_attention``, and the head-tail split of a sequence."""

import functools

import pytest
import torch
import torch.nn.functional as F

from trainmesh.parallel.context_parallel import blockwise_attention, chunk_starts, local_positions, shard_sequence
from trainmesh.layout import Layout, LayoutError
from trainmesh.layout import validate as validate_layout
from trainmesh.models.spec import ModelShape

from trainmesh.distributed.mesh import Mesh, init_distributed
from trainmesh.distributed.testing import run_ranks

from helpers import check_equivalent
from helpers import config as run_config

TOL = 1e-12  # fp64: the merge reorders sums of a few hundred terms


def _inputs(heads: int, kv_heads: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, seq, 8), (2, kv_heads, seq, 8), (2, kv_heads, seq, 8)]
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


def _reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=causal)


def _head_tail(q, k, v, cp, causal):
    """Every "rank" of a cp ring computes its head-tail queries over every rank's key/value block; the
    outputs are put back in sequence order."""
    seq = q.shape[2]
    held = [local_positions(seq, cp, r) for r in range(cp)]
    k_blocks = [k[:, :, idx] for idx in held]
    v_blocks = [v[:, :, idx] for idx in held]
    starts = [chunk_starts(seq, cp, r) for r in range(cp)]
    parts = [blockwise_attention(q[:, :, idx], k_blocks, v_blocks, starts[r], starts, causal)
             for r, idx in enumerate(held)]
    return torch.cat(parts, 2).index_select(2, torch.argsort(torch.cat(held)))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp,heads,kv_heads", [(1, 4, 4), (2, 4, 4), (3, 4, 2), (4, 4, 1)])
def test_blockwise_merge_equals_sdpa_forward_and_backward(causal, cp, heads, kv_heads):
    q, k, v = _inputs(heads, kv_heads, 48)
    grad = torch.randn(2, heads, 48, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _reference(q, k, v, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = _head_tail(q, k, v, cp, causal)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert (out - ref).abs().max() < TOL
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() < TOL


def test_contiguous_blocks_in_any_order_merge_the_same():
    """Blocks arriving out of order (as on every rank but the first) and uneven query segments."""
    q, k, v = _inputs(2, 2, 32, seed=3)
    blocks = [(k[:, :, s:s + 8], v[:, :, s:s + 8], [s]) for s in (24, 8, 0, 16)]
    out = blockwise_attention(q, [b[0] for b in blocks], [b[1] for b in blocks], [0, 16], [b[2] for b in blocks])
    assert (out - _reference(q, k, v, True)).abs().max() < TOL


def test_head_tail_split_balances_causal_work_and_covers_the_sequence():
    seq, cp = 96, 4
    held = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    visible = [int((p + 1).sum()) for p in held]  # a query at position p sees p + 1 keys
    assert len(set(visible)) == 1
    ids = torch.arange(seq).repeat(2, 1)
    assert torch.equal(shard_sequence(ids, cp, 1), held[1].repeat(2, 1))


def test_split_errors_name_the_fix():
    def shape(seq_len: int, kv_heads: int) -> ModelShape:
        return ModelShape(2, 64, 4, 256, 256, seq_len, n_kv_heads=kv_heads)

    with pytest.raises(LayoutError, match=r"2\*cp=4"):
        validate_layout(Layout(cp=2), shape(90, 4))
    validate_layout(Layout(cp=2), shape(96, 4))
    with pytest.raises(LayoutError, match=r"n_kv_heads=2 do not divide by it; choose cp in \{1, 2\}"):
        validate_layout(Layout(cp=4, cp_impl="a2a"), shape(96, 2))
    validate_layout(Layout(cp=2, cp_impl="a2a"), shape(96, 2))


# --- equivalence to one process (float64, helpers.FP64_ATOL) ---------------------------------------------

_cfg = functools.partial(run_config, cp=2, steps=3, global_batch=4, warmup_steps=1, seq_len=96)


def _grad_and_expert_group_ranks() -> list[dict[str, list[int]]]:
    """Each axis group's global ranks as this rank sees them, on a cp2 x tp2 mesh with ep2 and a pp2 x cp2 one."""
    import torch.distributed as dist
    init_distributed("gloo", torch.device("cpu"))
    meshes = [Mesh.build(pp=1, dp=1, tp=2, device=torch.device("cpu"), timeout_s=60, cp=2, ep=2),
              Mesh.build(pp=2, dp=1, tp=1, device=torch.device("cpu"), timeout_s=60, cp=2)]
    return [{axis: dist.get_process_group_ranks(mesh.group(axis)) for axis in ("dp_cp", "ep", "cp")
             if mesh.group(axis) is not None} for mesh in meshes]


def test_the_dp_cp_group_holds_the_ranks_sharing_pp_and_tp():
    """The gradient group is built with public ``new_group`` calls: at cp2 x tp2 its ranks are strided by tp,
    at pp2 x cp2 they stay inside a stage; ep folds inside it."""
    seen = run_ranks(_grad_and_expert_group_ranks, 4, timeout=60)
    for rank, (cp_tp, pp_cp) in enumerate(seen):
        assert cp_tp == {"dp_cp": [rank % 2, rank % 2 + 2], "ep": [rank % 2, rank % 2 + 2],
                         "cp": [rank % 2, rank % 2 + 2]}
        assert pp_cp == {"dp_cp": [rank // 2 * 2, rank // 2 * 2 + 1], "cp": [rank // 2 * 2, rank // 2 * 2 + 1]}


def test_cp2_ring_and_a2a_match_single_process():
    """GPT (learned positions) and Llama (RoPE, GQA), each through the ring and through the all-to-all."""
    check_equivalent([_cfg(), _cfg(cp_impl="a2a"), _cfg(model="llama-tiny"), _cfg(model="llama-tiny", cp_impl="a2a")],
                     world_size=2)


def test_cp2_with_dp_zero3_tp_sp_and_pp_match_single_process():
    """cp composed with each other form, for both families: gradients reduced and ZeRO-3 sharded over dp x cp,
    the sequence split over cp x tp under SP, the cp shard of activations sent between pipeline stages."""
    world = {"microbatches": 2}
    check_equivalent([_cfg(**world, dp=2, zero=3), _cfg(**world, dp=2, model="llama-tiny", recompute="selective"),
                      _cfg(**world, tp=2, sequence_parallel=True, cp_impl="a2a"),
                      _cfg(**world, tp=2, model="llama-tiny", sequence_parallel=True),
                      _cfg(**world, pp=2), _cfg(**world, pp=2, model="llama-tiny", zero=1)], world_size=4, timeout=400)


@pytest.mark.slow
def test_cp4_ring_and_a2a_match_single_process():
    cp4 = {"cp": 4}
    check_equivalent([_cfg(**cp4), _cfg(**cp4, cp_impl="a2a"), _cfg(**cp4, model="llama-tiny")], world_size=4,
                     timeout=400)
