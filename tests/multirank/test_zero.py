"""ZeRO stages 1-3: the same training as one process; model state and traffic per rank as the paper's
formulas say, in fp32 and in mixed precision; fp16 overflow skips the step on every rank; stage 3 gathers
each unit once per pass, prefetches the next and frees what it is done with."""

import math

import pytest
import torch
from torch import nn

import trainmesh as tm
from trainmesh.distributed.mesh import Mesh
from trainmesh.models.gpt import GPT, PRESETS
from trainmesh.distributed.testing import run_ranks
from trainmesh.tracking.metrics import SavedActivations, per_rank_stats
from trainmesh.parallel.zero import (FlatLayout, default_units, model_state_bytes_formula,
                            step_comm_bytes_formula)
from trainmesh.parallel.zero.stage3 import lenders, own_params

from helpers import Case, build, check_equivalent, config, mesh_of, nan_gradients, train

TINY = PRESETS["tiny"]
PSI = TINY.n_params()


def _cfg(dp: int, zero: int, microbatches: int = 1, **kw) -> Case:
    return config(**{"dp": dp, "zero": zero, "microbatches": microbatches, "steps": 8,
                     "global_batch": 12 if dp == 3 else 8, **kw})


# --- equivalence: per-step losses and final full parameters match one process --------------------------


def _stage_cfgs(dp: int) -> list[Case]:
    """Every stage with gradient accumulation, stages 1-2 over several buckets."""
    return [_cfg(dp, 1, 2, bucket_mb=0.1), _cfg(dp, 2, 2, bucket_mb=0.1), _cfg(dp, 3, 2)]


def test_zero_matches_single_process_dp2():
    check_equivalent([*_stage_cfgs(2), _cfg(2, 3, 1)], world_size=2)


@pytest.mark.slow  # dp2 (default set) covers every stage; dp4 adds a wider shard
def test_zero_matches_single_process_dp4():
    check_equivalent(_stage_cfgs(4), world_size=4, timeout=400)


def test_zero_pads_shards_for_a_world_that_divides_nothing():
    """N = 3 divides no unit of the tiny GPT, so every shard is padded and pieces straddle parameters."""
    check_equivalent([_cfg(3, 2, 2, bucket_mb=0.1), _cfg(3, 3, 2)], world_size=3, timeout=400)


def test_zero3_in_one_process_trains_like_plain_dp():
    """N = 1 runs all of stage 3's hooks (gather, free, reduce-scatter as copies) without processes."""
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    plain = train(_cfg(1, 0, 2, steps=4), mesh=mesh)
    sharded = train(_cfg(1, 3, 2, steps=4), mesh=mesh)
    assert sharded.losses == pytest.approx(plain.losses, abs=1e-6)


def test_compiled_zero3_compiles_each_block_once_and_computes_what_eager_does():
    """Only the blocks' forwards are compiled: stage 3's gather/free hooks around each block run eagerly,
    so no step after the first recompiles (traced hooks guarded on their Python records and recompiled on
    the second step). In float64 the compiled steps agree with eager ones to rounding."""
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))

    def losses(compile: bool) -> list[float]:
        cfg = _cfg(1, 3, 2, precision="fp64", compile=compile)
        run = build(cfg, mesh)
        out = []
        for step in range(3):
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                out.append(run.forward_backward(step).item())
            run.engine.step(cfg.lr, cfg.grad_clip)
        return out

    torch._dynamo.reset()
    assert losses(True) == pytest.approx(losses(False), rel=1e-12)


def test_compiled_zero3_at_dp2_matches_single_process():
    """--compile across ranks: each block's compiled forward between stage 3's eager gather/free hooks
    trains, in float64, as one process does."""
    check_equivalent([_cfg(2, 3, 2, compile=True)], world_size=2)


@pytest.mark.parametrize("stage,precision,reduce_dtype", [(1, "bf16", "fp32"), (2, "bf16", "bf16"),
                                                          (3, "bf16", "fp32"), (3, "fp16", "fp32")])
def test_mixed_precision_zero_in_one_process_trains_like_plain_dp(stage, precision, reduce_dtype):
    """N = 1: the same bf16/fp16 rounding as DataParallel's fp32-master path, step for step. Clipping is
    off because the norm, summed over pieces instead of whole tensors, may differ in the last bit, and a
    clip coefficient one ulp off can round a bf16 weight the other way."""
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    kw = dict(steps=4, precision=precision, reduce_dtype=reduce_dtype, grad_clip=0.0)
    plain = train(_cfg(1, 0, 2, **kw), mesh=mesh)
    sharded = train(_cfg(1, stage, 2, **kw), mesh=mesh)
    assert sharded.losses == pytest.approx(plain.losses, abs=1e-6)


def test_mixed_precision_keeps_low_precision_parameters_and_an_fp32_master_shard():
    cfg = _cfg(1, 3, precision="bf16", reduce_dtype="bf16")
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    run.forward_backward(0)
    run.engine.step(cfg.lr, cfg.grad_clip)
    groups = run.engine.groups
    assert all(g.shard.dtype == g.flat.dtype == torch.bfloat16 for g in groups)
    assert all(g.grad_shard.dtype == torch.bfloat16 and g.master.dtype == torch.float32 for g in groups)
    masters = {g.master.untyped_storage().data_ptr() for g in groups}
    assert all(q.dtype == torch.float32 and q.untyped_storage().data_ptr() in masters for q in run.engine.pieces)
    state = [t for s in run.engine.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert state and all(t.dtype == torch.float32 for t in state)
    with run.engine.gathered():
        assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_non_finite_gradient_skips_the_update(stage):
    cfg = _cfg(1, stage)
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    before = run.parallel.state_dict()
    poison = next(run.model.parameters()).register_hook(lambda g: torch.full_like(g, float("nan")))
    run.forward_backward(0)
    poison.remove()
    assert math.isnan(run.engine.step(cfg.lr, cfg.grad_clip))
    after = run.parallel.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _nan_step_traces(cfgs: list[Case]) -> list[tuple[list[tuple[float, float, bool]], int]]:
    """Per config: (loss scale before, after, full parameters unchanged) of every step, with rank 1's
    gradients NaN at step 2, and the steps the scaler skipped."""
    torch.set_num_threads(1)
    mesh = mesh_of(cfgs[0])
    out = []
    for cfg in cfgs:
        run = build(cfg, mesh)
        trace = []
        for step in range(cfg.steps):
            undo = nan_gradients(run) if (step, torch.distributed.get_rank()) == (2, 1) else lambda: None
            before = run.parallel.state_dict()
            run.forward_backward(step)
            scale = run.engine.loss_scale
            run.engine.step(cfg.lr, cfg.grad_clip)
            undo()
            after = run.parallel.state_dict()
            trace.append((scale, run.engine.loss_scale, all(torch.equal(before[k], after[k]) for k in before)))
        out.append((trace, run.engine.scaler.skipped_steps))
    return out


def test_fp16_nan_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale():
    stages = (1, 2, 3)
    cfgs = [_cfg(2, z, steps=5, precision="fp16") for z in stages]
    ranks = run_ranks(_nan_step_traces, 2, cfgs, timeout=240)
    for k, stage in enumerate(stages):
        (trace, skipped), (other, other_skipped) = ranks[0][k], ranks[1][k]
        assert trace == other and skipped == other_skipped == 1, f"stage {stage}: ranks disagree or skipped {skipped}"
        assert [unchanged for _, _, unchanged in trace] == [False, False, True, False, False], f"stage {stage}"
        before, after, _ = trace[2]
        assert before == 2.0**16 and after == before / 2, f"stage {stage}: scale {before} -> {after}"


# --- memory and communication of a run's last step ----------------------------------------------------


def _last_step(case: Case) -> dict:
    """What a run records of its last step: the loss, the gradient norm, the bytes each op moved in it and
    every rank's model state and saved activation bytes (of the first step's first micro-batch)."""
    run = build(case)
    saved = SavedActivations(run.model.parameters())
    for step in range(case.steps):
        before = run.comm.snapshot()
        loss = tm.train_step(run.parallel, run.opt, run.batch(step), max_norm=case.grad_clip,
                             saved=saved if step == 0 else None)
    moved = {op: n - before.get(op, 0) for op, n in run.comm.snapshot().items() if n - before.get(op, 0)}
    return {"loss": loss, "grad_norm": run.opt.grad_norm, "comm_bytes_by_op": moved,
            **per_rank_stats(run.engine.state_tensors(), run.mesh.device, saved.bytes)}


def _last_steps(cases: list[Case]) -> list[dict]:
    torch.set_num_threads(1)
    return [_last_step(case) for case in cases]


MIXED = ("bf16", "fp32")  # bf16 parameters with the reduce dtype fp32 (default) or bf16 (the paper's)


@pytest.fixture(scope="module")
def dp2_records():
    """Last-step metrics of stages 0-3 at N = 2 (and stage 2 with two micro-batches), and of stages 0-3
    in bf16 with either reduce dtype (``bf16-<reduce dtype>-<stage>``), one run."""
    cases = {"0": (0, 1, {}), "1": (1, 1, {}), "2": (2, 1, {}), "3": (3, 1, {}), "2x2": (2, 2, {})}
    cases |= {f"bf16-{rd}-{z}": (z, 1, {"precision": "bf16", "reduce_dtype": rd}) for rd in MIXED for z in range(4)}
    records = run_ranks(_last_steps, 2, [_cfg(2, z, m, steps=3, **kw) for z, m, kw in cases.values()], timeout=300)
    return dict(zip(cases, records[0]))


def _slack(n: int, n_groups: int, bytes_per_element: int = 16) -> int:
    """What the formulas leave out: AdamW's 4-byte step counter per optimizer tensor (at most one per
    parameter and group boundary) and padding, at most N-1 elements of ``bytes_per_element`` per group."""
    n_tensors = len(list(GPT(TINY).parameters()))
    return 4 * (n_tensors + n_groups) + bytes_per_element * (n - 1) * n_groups


def test_model_state_bytes_follow_the_zero_formulas(dp2_records):
    n, units = 2, len(default_units(GPT(TINY)))
    for stage in (0, 1, 2, 3):
        formula = model_state_bytes_formula(PSI, n, stage)
        for rank, held in enumerate(dp2_records[str(stage)]["model_state_bytes"]):
            assert formula <= held <= formula + _slack(n, units), f"stage {stage} rank {rank}: {held} vs {formula}"
    stage0 = max(dp2_records["0"]["model_state_bytes"])
    largest_unit = 4 * max(sum(p.numel() for p in m.parameters()) for _, m in default_units(GPT(TINY)))
    assert max(dp2_records["3"]["model_state_bytes"]) <= 1.10 * stage0 / n + largest_unit


@pytest.mark.parametrize("reduce_dtype", MIXED)
def test_mixed_precision_model_state_bytes_follow_the_zero_formulas(dp2_records, reduce_dtype):
    """bf16 parameters, fp32 masters and moments sharded from stage 1. With bf16 gradients these are the
    paper's 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; with fp32 gradients the gradient term doubles."""
    n, units, g = 2, len(default_units(GPT(TINY))), {"bf16": 2, "fp32": 4}[reduce_dtype]
    expected = {0: (2 + g + 12) * PSI, 1: (2 + g) * PSI + 12 * PSI / n, 2: 2 * PSI + (g + 12) * PSI / n,
                3: (2 + g + 12) * PSI / n}
    for stage in (0, 1, 2, 3):
        formula = model_state_bytes_formula(PSI, n, stage, mixed_precision=True, grad_bytes=g)
        assert formula == expected[stage]
        for rank, held in enumerate(dp2_records[f"bf16-{reduce_dtype}-{stage}"]["model_state_bytes"]):
            assert formula <= held <= formula + _slack(n, units, 2 + g + 12), \
                f"bf16 reduce {reduce_dtype} stage {stage} rank {rank}: {held} vs {formula}"


def test_zero3_activation_bytes_exclude_regathered_parameters(dp2_records):
    for name in ("3", "bf16-fp32-3"):
        stage0 = dp2_records["0" if name == "3" else "bf16-fp32-0"]["activation_bytes"]
        assert dp2_records[name]["activation_bytes"] == stage0


def test_grad_norm_and_loss_are_of_the_whole_model(dp2_records):
    for name in ("1", "2", "3"):
        assert dp2_records[name]["loss"] == pytest.approx(dp2_records["0"]["loss"], abs=1e-5)
        assert dp2_records[name]["grad_norm"] == pytest.approx(dp2_records["0"]["grad_norm"], rel=1e-5)


def test_step_traffic_per_op(dp2_records):
    """Tiny's groups all split evenly over N = 2, so the counted bytes equal the formulas exactly."""
    n, one_pass = 2, 4 * PSI / 2
    by_op = {name: r["comm_bytes_by_op"] for name, r in dp2_records.items()}
    dp = by_op["0"]["dp/all_reduce"]
    assert dp == step_comm_bytes_formula(PSI, n, 0)
    for stage in ("1", "2"):
        assert by_op[stage]["dp/grad_reduce_scatter"] == by_op[stage]["dp/param_all_gather"] == one_pass
        assert by_op[stage]["dp/grad_reduce_scatter"] + by_op[stage]["dp/param_all_gather"] == dp
    assert by_op["2x2"]["dp/grad_reduce_scatter"] == 2 * one_pass
    stage3 = by_op["3"]
    assert stage3["dp/fwd_param_all_gather"] == stage3["dp/bwd_param_all_gather"] == one_pass
    assert stage3["dp/grad_reduce_scatter"] == one_pass
    moved = sum(v for k, v in stage3.items() if k != "dp/grad_norm")
    assert moved == step_comm_bytes_formula(PSI, n, 3) == 1.5 * dp
    assert all(v <= 8 for k, v in stage3.items() if k == "dp/grad_norm")


# --- stage 3 and stage 2 schedules: events of one step -----------------------------------------------


def _one_step_events(cfgs: list[Case]) -> dict[int, tuple]:
    """Per config: engine events of one forward/backward, what is still held after it, and the exported
    full state dict after the step."""
    torch.set_num_threads(1)
    mesh = mesh_of(cfgs[0])
    out = {}
    for cfg in cfgs:
        run = build(cfg, mesh)
        run.forward_backward(0)
        events = list(run.engine.events)
        units = [u.name for u in getattr(run.engine, "units", [])]
        still_gathered = [u.name for u in getattr(run.engine, "units", []) if u.gathered]
        full_grads_held = [g.name for g in run.engine.groups if g.grad_flat is not None]
        run.engine.step(cfg.lr, cfg.grad_clip)
        with run.engine.gathered() if units else torch.no_grad():
            exported = {k: v.clone() for k, v in run.model.state_dict().items()}
        out[cfg.zero] = events, units, still_gathered, full_grads_held, exported
    return out


@pytest.fixture(scope="module")
def one_step():
    return run_ranks(_one_step_events, 2, [_cfg(2, 3), _cfg(2, 2, bucket_mb=0.05)])[0]


def test_zero3_prefetches_overlaps_and_frees(one_step):
    events, units, still_gathered, full_grads_held, exported = one_step[3]
    gathers = sorted(e[1:] for e in events if e[0] == "gather")
    passes = ("fwd_param_all_gather", "bwd_param_all_gather")
    assert gathers == sorted((u, op) for u in units for op in passes), "one gather per unit per pass"
    for k in range(len(units) - 1):
        prefetch = events.index(("gather", units[k + 1], "fwd_param_all_gather"))
        assert prefetch < events.index(("forward", units[k])), f"{units[k + 1]} not prefetched during {units[k]}"
    for k in range(1, len(units)):
        prefetch = events.index(("gather", units[k - 1], "bwd_param_all_gather"))
        assert prefetch < events.index(("reduce_scatter", units[k])), f"{units[k - 1]} not prefetched in backward"
        assert events[prefetch + 1] == ("ready", units[k]), f"{units[k - 1]} not prefetched by {units[k]}'s gradients"
    kinds = [e[0] for e in events]
    assert kinds.index("reduce_scatter") < len(kinds) - 1 - kinds[::-1].index("ready"), "no overlap with backward"
    assert still_gathered == [] and full_grads_held == [], "parameters or full gradients kept after backward"
    plain = GPT(TINY)
    plain.load_state_dict(exported)
    assert exported.keys() == plain.state_dict().keys()


def test_zero2_reduce_scatters_buckets_during_backward(one_step):
    events, _, _, full_grads_held, _ = one_step[2]
    kinds = [e[0] for e in events]
    launches = [name for kind, name in events if kind == "reduce_scatter"]
    assert len(launches) > 2 and launches == sorted(launches, key=lambda b: int(b.removeprefix("bucket")))
    assert kinds.index("reduce_scatter") < len(kinds) - 1 - kinds[::-1].index("ready"), "no overlap with backward"
    assert full_grads_held == [], "a full gradient bucket outlived its reduce-scatter"


def _in_step_peaks(cfgs: list[Case]) -> list[int]:
    """The most model state each config's engine held at any point of one training step."""
    torch.set_num_threads(1)
    mesh = mesh_of(cfgs[0])
    peaks = []
    for cfg in cfgs:
        run = build(cfg, mesh)
        run.engine.peak_state_bytes = 0
        run.forward_backward(0)
        run.engine.step(cfg.lr, cfg.grad_clip)
        peaks.append(run.engine.peak_state_bytes)
    return peaks


def test_zero2_in_step_peak_falls_below_zero1_with_one_bucket_for_every_gradient():
    """With the default 25 MB bucket every gradient of tiny fits in one bucket: stage 2 must still never
    hold them all at once (stage 1 does, by design), so its peak falls below stage 1's."""
    stage1, stage2 = run_ranks(_in_step_peaks, 2, [_cfg(2, 1), _cfg(2, 2)])[0]
    assert stage2 < stage1, f"stage 2 peaked at {stage2} bytes, stage 1 at {stage1}"
    assert stage2 <= model_state_bytes_formula(PSI, 2, 2) + 4 * PSI / 2, "more than one shard of full gradients"


# --- pure pieces: layouts, formulas, wrapping policy, config errors -----------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_flat_layout_shards_cover_every_element_once(world):
    shapes = [torch.Size(s) for s in ((5, 3), (7,), (1,), (4, 4, 2), (11,))]
    covered = []
    for rank in range(world):
        layout = FlatLayout.build(shapes, world, rank)
        assert layout.padded % world == 0 and 0 <= layout.padded - layout.numel < world
        start = rank * layout.shard_numel
        for i, a, b in layout.pieces():
            lo, hi = layout.offsets[i], layout.offsets[i] + shapes[i].numel()
            assert lo <= start + a < start + b <= hi
            covered += range(start + a, start + b)
    assert sorted(covered) == list(range(sum(s.numel() for s in shapes)))


def test_formulas_reproduce_the_papers_figure_1():
    """Fig. 1 of the paper: Ψ = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    gb = [model_state_bytes_formula(7_500_000_000, 64, s, mixed_precision=True) / 1e9 for s in (0, 1, 2, 3)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]
    assert step_comm_bytes_formula(100, 4, 1) == step_comm_bytes_formula(100, 4, 0)
    assert step_comm_bytes_formula(100, 4, 3) == 1.5 * step_comm_bytes_formula(100, 4, 0)


def test_default_units_are_embed_blocks_norm_head():
    names = [name for name, _ in default_units(GPT(TINY))]
    assert names == ["embed", *(f"blocks.{i}" for i in range(TINY.n_layers)), "ln_f", "head"]


def test_wrapping_policy_rejects_uncovered_parameters_and_lends_shared_ones():
    """A parameter two units share is the later one's; the earlier borrows it (gathers the later unit too)."""
    model = nn.Sequential(nn.Linear(2, 2))
    model.register_parameter("loose", nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match="loose.*belong to no ZeRO-3 unit"):
        default_units(model)
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    units = default_units(tied)
    owned = own_params(units)
    assert [len(params) for params in owned] == [1, 2] and owned[0][0] is tied[0].bias
    assert lenders(units, owned) == [[1], []]


def test_zero_rejects_an_unknown_stage_with_the_fix():
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^zero=4: choose 0, 1, 2 or 3$"):
        tm.parallelize(GPT(TINY), mesh, zero=4)
