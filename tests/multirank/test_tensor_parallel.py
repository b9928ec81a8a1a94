"""Tensor parallel (Megatron-style) with sequence parallelism: same losses and parameters as one process,
1/tp of the sharded bytes per rank, exactly the communication the papers count, any plain module by a
plan, and full (unsharded) weights loaded into a sharded model."""

import copy

import pytest
import torch
from torch import nn

from trainmesh.parallel.tensor_parallel import apply_tensor_parallel
import trainmesh as tm
from trainmesh.distributed.mesh import Mesh
from trainmesh.layout import Layout, LayoutError, flag, validate
from trainmesh.tracking.metrics import SavedActivations
from trainmesh.models import GPT_PLAN
from trainmesh.models.gpt import GPT, PRESETS, ModelConfig, cross_entropy
from trainmesh.training.optim import is_tp_sharded
from trainmesh.parallel.tensor_parallel import ShardSpec, load_full_state_dict, shard_tensor, unsharded_state_dict
from trainmesh.distributed.testing import run_ranks

from helpers import Case, build, check_equivalent, config

TINY = PRESETS["tiny"]


def _cfg(tp: int, dp: int = 1, sp: bool = False, microbatches: int = 1, zero: int = 0) -> Case:
    return config(dp=dp, tp=tp, sequence_parallel=sp, zero=zero, microbatches=microbatches)


def _mesh_at(tp: int, rank: int) -> Mesh:
    """This rank's view of a tp mesh, without processes: enough to shard weights (no collective runs)."""
    return Mesh({"pp": 1, "dp": 1, "cp": 1, "tp": tp}, {"pp": 0, "dp": 0, "cp": 0, "tp": rank}, torch.device("cpu"))


# --- equivalence with a single process ---------------------------------------------------------------

def test_tp2_with_and_without_sequence_parallel_matches_single_process():
    check_equivalent([_cfg(2), _cfg(2, sp=True), _cfg(2, sp=True, microbatches=2)], world_size=2)


def test_tp4_and_dp2_tp2_with_zero3_match_single_process():
    check_equivalent([_cfg(4, sp=True), _cfg(2, dp=2, sp=True, zero=3)], world_size=4)


@pytest.mark.slow
def test_tp4_and_dp2_tp2_with_and_without_zero_match_single_process():
    check_equivalent([_cfg(4), _cfg(2, dp=2), _cfg(2, dp=2, sp=True, microbatches=2), _cfg(2, dp=2, zero=1)],
                     world_size=4)


# --- memory: parameters and activations --------------------------------------------------------------

SHARDED = {"embed.tok.weight", "head.weight"} | {
    f"blocks.{i}.{name}" for i in range(TINY.n_layers)
    for name in ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight", "mlp.fc.bias",
                 "mlp.proj.weight")}


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_layers_hold_one_tp_th_of_the_parameter_bytes(tp):
    full = {n: p.nbytes for n, p in GPT(TINY).named_parameters()}
    for rank in range(tp):
        model = GPT(TINY)
        apply_tensor_parallel(model, _mesh_at(tp, rank), GPT_PLAN)
        params = dict(model.named_parameters())
        assert {n for n, p in params.items() if is_tp_sharded(p)} == SHARDED
        for name, p in params.items():
            assert p.nbytes == (full[name] // tp if name in SHARDED else full[name]), name
        replicated = sum(full[n] for n in full if n not in SHARDED)
        assert sum(p.nbytes for p in params.values()) == replicated + sum(full[n] for n in SHARDED) // tp


def test_qkv_shard_takes_each_ranks_heads_from_q_k_and_v():
    full = torch.arange(12.0).reshape(12, 1)  # rows [q0 q1 q2 q3 | k0 .. | v0 ..] for 4 heads
    assert shard_tensor(full, ShardSpec(0, chunks=3), rank=1, size=2).flatten().tolist() == [2, 3, 6, 7, 10, 11]


# --- communication and activation shapes, counted over one step --------------------------------------

def expected_tp_bytes(m: ModelConfig, micro_batch: int, tp: int, sp: bool) -> dict[str, float]:
    """Bytes one rank sends over tp in a step of one micro-batch, by op (ring volumes, see comm.py).

    Megatron-LM §3: each block all-reduces the [B, T, d] activation after attention and after the MLP in
    forward (g) and before each in backward (f); the vocab-parallel embedding adds one in forward, the
    vocab-parallel head one in backward, so 4L + 2 all-reduces of S = 4·B·T·d bytes, 2(t-1)/t·S each.
    Korthikanti et al. §4.2.2: under SP each becomes an all-gather in one direction and a reduce-scatter
    in the other, (t-1)/t·S each; each of the 2L + 1 column-parallel layers (qkv, fc, head) all-gathers
    its saved input slice again in backward; and the position-embedding gradient [T, d] is all-gathered
    and the 6L + 2 replicated d-vectors of the sequence region (LayerNorms, row biases) summed over tp.
    The cross-entropy all-reduces 3 floats per token (max, target logit, sum of exponentials), the
    global gradient norm one float64 (summed in double precision whatever the training dtype).
    """
    ring, s = (tp - 1) / tp, 4 * micro_batch * m.seq_len * m.d_model
    n = 4 * m.n_layers + 2
    out = {"cross_entropy": 2 * ring * 4 * 3 * micro_batch * m.seq_len, "grad_norm": 2 * ring * 8}
    if not sp:
        return {**out, "all_reduce": n * 2 * ring * s}
    regather = 2 * m.n_layers + 1
    return {**out, "all_gather": (n + regather) * ring * s + ring * 4 * m.seq_len * m.d_model,
            "reduce_scatter": n * ring * s,
            "sequence_grads": 2 * ring * 4 * (6 * m.n_layers + 2) * m.d_model}


def _one_step(cfgs: list[Case]) -> list[tuple[dict[str, float], list[torch.Size], int]]:
    return [_step_counts(cfg) for cfg in cfgs]


def _step_counts(cfg: Case) -> tuple[dict[str, float], list[torch.Size], int]:
    """tp bytes by op over one training step, the input shape of every LayerNorm, the saved activations."""
    torch.set_num_threads(1)
    run = build(cfg)
    shapes = []
    for module in run.model.modules():
        if isinstance(module, nn.LayerNorm):
            module.register_forward_hook(lambda _m, args, _out: shapes.append(args[0].shape))
    saved = SavedActivations(run.model.parameters())
    run.forward_backward(0, saved)
    run.engine.step(cfg.lr, cfg.grad_clip)
    return {op: b for (axis, op), b in run.comm.bytes.items() if axis == "tp"}, shapes, saved.bytes


def sequence_region_bytes(m: ModelConfig, micro_batch: int) -> int:
    """What backward keeps of the sequence-parallel region: for each of the 2L + 1 LayerNorms its input,
    its output (the next column-parallel layer's input) and its mean and 1/std (Korthikanti et al.,
    2022, §4.2.2: under SP all of them are stored split along the sequence)."""
    return (2 * m.n_layers + 1) * 4 * micro_batch * m.seq_len * (2 * m.d_model + 2)


def test_one_step_communication_and_activations_match_the_papers():
    cfgs = [_cfg(2), _cfg(2, sp=True)]
    results = run_ranks(_one_step, 2, cfgs)[0]
    for cfg, (counted, shapes, _) in zip(cfgs, results):
        sp = cfg.sequence_parallel
        expected = expected_tp_bytes(TINY, cfg.micro_batch, 2, sp)
        assert counted.keys() == expected.keys()
        for op in expected:
            assert counted[op] == pytest.approx(expected[op], rel=1e-12), (sp, op)
        seq = TINY.seq_len // 2 if sp else TINY.seq_len
        assert shapes == [torch.Size([cfg.micro_batch, seq, TINY.d_model])] * (2 * TINY.n_layers + 1)
    (_, _, plain), (_, _, split) = results
    assert plain - split == sequence_region_bytes(TINY, cfgs[0].micro_batch) // 2, "SP keeps 1/tp of the region"


# --- a user's own model, and full weights ------------------------------------------------------------

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _user_model_step() -> tuple[float, float]:
    """Forward, backward and an SGD step of a plain MLP, split by a two-line plan vs. the same MLP whole."""
    mesh = tm.init_mesh(tp=2, device="cpu")
    ref, model = _mlp(), _mlp()
    assert apply_tensor_parallel(model, mesh, {"0": "colwise", "2": "rowwise"}) is None
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    outputs = []
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = m(x)
        out.square().mean().backward()
        opt.step()
        outputs.append(out.detach())
    params = unsharded_state_dict(model)
    return ((outputs[0] - outputs[1]).abs().max().item(),
            max((params[k] - v).abs().max().item() for k, v in ref.state_dict().items()))


def test_users_plain_module_parallelized_by_a_custom_plan():
    out_diff, param_diff = run_ranks(_user_model_step, 2)[0]
    assert out_diff < 1e-6 and param_diff < 1e-6


def _load_full_weights() -> list[tuple[bool, float]]:
    return [_load_and_compare(sp) for sp in (False, True)]


def _load_and_compare(sp: bool) -> tuple[bool, float]:
    """Full weights of another seed loaded into a sharded GPT: gathered back bit for bit, same loss."""
    mesh = tm.init_mesh(tp=2, device="cpu", sequence_parallel=sp)
    model, source = GPT(TINY, seed=0), GPT(TINY, seed=1)
    criterion = apply_tensor_parallel(model, mesh, GPT_PLAN, sp)
    load_full_state_dict(model, source.state_dict())
    gathered = unsharded_state_dict(model)
    exact = all(torch.equal(gathered[k], v) for k, v in source.state_dict().items())
    x, y = (torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=torch.Generator().manual_seed(s))
            for s in (2, 3))
    with pytest.raises(KeyError, match="missing"):
        load_full_state_dict(model, {k: v for k, v in source.state_dict().items() if k != "head.weight"})
    return exact, abs(criterion(model(x), y).item() - cross_entropy(source(x), y).item())


def test_full_weights_load_into_a_tp_model_with_and_without_sp():
    for exact, loss_diff in run_ranks(_load_full_weights, 2)[0]:
        assert exact and loss_diff < 1e-5


# --- errors before anything runs ---------------------------------------------------------------------

def test_plan_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="tp=3 does not divide vocab size=256 of embed.tok; .* or pad"):
        apply_tensor_parallel(GPT(TINY), _mesh_at(3, 0), GPT_PLAN)
    with pytest.raises(ValueError, match="tp=3 does not divide out_features/3=64 of blocks.0.attn.qkv"):
        apply_tensor_parallel(GPT(TINY), _mesh_at(3, 0), {"blocks.*.attn.qkv": "colwise_qkv"})
    with pytest.raises(ValueError, match="'blocks.*.mlp.fc2' matches no module"):
        apply_tensor_parallel(GPT(TINY), _mesh_at(2, 0), {"blocks.*.mlp.fc2": "colwise"})
    with pytest.raises(ValueError, match="unknown plan style 'diagonal'"):
        apply_tensor_parallel(GPT(TINY), _mesh_at(2, 0), {"head": "diagonal"})
    with pytest.raises(TypeError, match="'rowwise' applies to Linear, but blocks.0.ln1 is a LayerNorm"):
        apply_tensor_parallel(GPT(TINY), _mesh_at(2, 0), {"blocks.0.ln1": "rowwise"})
    model = copy.deepcopy(_mlp())
    apply_tensor_parallel(model, _mesh_at(1, 0), {"0": "colwise"})
    assert isinstance(model[0], nn.Linear), "tp=1 leaves the model as it is"


def test_layout_rejects_sequence_parallel_that_cannot_split():
    validate(Layout(tp=4, sequence_parallel=True), TINY.shape(), 4, spell=flag)
    with pytest.raises(LayoutError, match="set --tp > 1 or drop --sequence-parallel"):
        validate(Layout(sequence_parallel=True), TINY.shape(), 1, spell=flag)
    odd = ModelConfig(2, 64, 4, 256, 256, seq_len=30).shape()
    with pytest.raises(LayoutError, match="splits the 30 tokens of each sequence over --tp 4, which does not divide"):
        validate(Layout(tp=4, sequence_parallel=True), odd, 4, spell=flag)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_torch_peer_of_bench_tp_gets_each_familys_plan_with_fused_rows_per_rank(name):
    """``trainmesh bench tp --model X`` translates X's own plan for torch: after the reorder, torch's
    contiguous row split gives each rank exactly trainmesh's shard of every fused projection."""
    from trainmesh_bench.tp import torch_tp_plan
    from trainmesh.models import preset, spec_of

    spec, tp = spec_of(name), 2
    model = spec.builder(preset(name), 0)
    original = copy.deepcopy(model)
    styles = torch_tp_plan(model, dict(spec.tp_plan), tp)
    fused = {n: s for n, s in spec.tp_plan.items() if s in ("colwise_qkv", "colwise_pair")}
    assert fused and not any("norm" in n or n.startswith("ln") for n in styles)
    for pattern, style in fused.items():
        module_name = pattern.replace("*", "0")
        chunks = 3 if style == "colwise_qkv" else 2
        weight, before = model.get_submodule(module_name).weight, original.get_submodule(module_name).weight
        for r in range(tp):
            rows = weight.shape[0] // tp
            assert torch.equal(weight[r * rows:(r + 1) * rows], shard_tensor(before, ShardSpec(0, chunks=chunks), r, tp))
