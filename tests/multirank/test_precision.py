"""Mixed precision and activation recomputation: bf16 tracks fp32, fp16 overflow skips a step on every
rank and backs the scale off, recomputation changes memory but not the losses."""

import functools

import pytest
import torch

from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.testing import run_ranks

from helpers import Built, Case, activation_bytes, build, config, nan_gradients, train


# bf16 has an 8-bit mantissa: per-step losses of the tiny preset drift from fp32 by up to a few 1e-2, and
# one step of the tiny run (step 19) is sensitive enough that a 1-ulp change of the clip norm moves DP's
# per-step max |bf16 - fp32| anywhere in 0.004-0.19 across machines (means 0.001-0.011 throughout). So the
# curves are compared as 5-step running means (within 0.036 in every measured variant) and by their final
# evaluation loss, never step by step.
BF16_MAX_ABS_DIFF = 0.05
BF16_MEAN_ABS_DIFF = 0.02
BF16_VAL_ABS_DIFF = 0.05
TRACKING_WINDOW = 5


_cfg = functools.partial(config, steps=50, warmup_steps=5)


def _single(cfg: Case) -> Built:
    return train(cfg, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))


@pytest.fixture(scope="module")
def fp32_run() -> tuple[list[float], float]:
    """The single-process fp32 curve and final evaluation loss every bf16 run is held to."""
    result = _single(_cfg())
    return result.losses, result.evaluate()


def _running_mean(xs: list[float], window: int) -> list[float]:
    return [sum(xs[i:i + window]) / window for i in range(len(xs) - window + 1)]


def _assert_tracks(fp32_run: tuple[list[float], float], bf16_run: tuple[list[float], float], what: str) -> None:
    """Mean per-step |bf16 - fp32| under BF16_MEAN_ABS_DIFF, the largest gap between the two curves'
    TRACKING_WINDOW-step running means under BF16_MAX_ABS_DIFF, the final evaluation losses within
    BF16_VAL_ABS_DIFF."""
    (fp32, fp32_val), (bf16, bf16_val) = fp32_run, bf16_run
    assert len(bf16) == len(fp32)
    assert abs(bf16_val - fp32_val) < BF16_VAL_ABS_DIFF, f"{what}: val loss {bf16_val} vs fp32 {fp32_val}"
    diffs = [abs(a - b) for a, b in zip(fp32, bf16)]
    assert sum(diffs) / len(diffs) < BF16_MEAN_ABS_DIFF, f"{what}: mean |bf16 - fp32| {sum(diffs) / len(diffs)}"
    gaps = [abs(a - b) for a, b in zip(_running_mean(fp32, TRACKING_WINDOW), _running_mean(bf16, TRACKING_WINDOW))]
    assert max(gaps) < BF16_MAX_ABS_DIFF, f"{what}: max |bf16 - fp32| over {TRACKING_WINDOW}-step means {max(gaps)}"
    assert bf16[-1] < bf16[0] - 1.5, f"{what}: loss {bf16[0]} -> {bf16[-1]}"


def _losses_and_val(cfgs: list[Case]) -> list[tuple[list[float], float]]:
    torch.set_num_threads(1)
    return [(result.losses, result.evaluate()) for result in map(train, cfgs)]


def test_bf16_data_parallel_and_zero_track_fp32(fp32_run):
    """bf16 parameters with fp32 masters under DP, and fp32 master shards under ZeRO-1 and ZeRO-3, at N = 2.
    (ZeRO's bf16 curve equals DP's bit for bit with clipping off; with clipping its global norm is summed
    over shards and may differ from DP's in the last bit, which the window absorbs.)"""
    stages = (0, 1, 3)
    runs = run_ranks(_losses_and_val, 2, [_cfg(dp=2, zero=z, precision="bf16") for z in stages],
                     timeout=300)
    for stage, bf16_run in zip(stages, runs[0]):
        _assert_tracks(fp32_run, bf16_run, f"ZeRO-{stage}" if stage else "DP")


def _fp16_overflow_rank(cfg: Case, nan_at: tuple[int, int]):
    """The trace of every step, with the gradients of rank ``nan_at[0]`` NaN at step ``nan_at[1]``."""
    torch.set_num_threads(1)
    run = build(cfg)
    rank = torch.distributed.get_rank()
    trace = []
    for step in range(cfg.steps):
        undo = nan_gradients(run) if (rank, step) == nan_at else lambda: None
        before = [p.detach().clone() for p in run.model.parameters()]
        run.forward_backward(step)
        scale = run.engine.loss_scale
        norm = run.engine.step(1e-3, 1.0)
        undo()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, run.model.parameters()))
        trace.append((scale, run.engine.loss_scale, norm, unchanged))
    return trace, run.engine.scaler.skipped_steps


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale():
    cfg = _cfg(dp=2, steps=5, precision="fp16")
    results = run_ranks(_fp16_overflow_rank, 2, cfg, (1, 2), timeout=240)
    for rank, (trace, skipped) in enumerate(results):
        assert skipped == 1, f"rank {rank} skipped {skipped} steps"
        scale_before, scale_after, norm, unchanged = trace[2]
        assert scale_after == scale_before / 2, f"rank {rank}: scale {scale_before} -> {scale_after}"
        assert unchanged, f"rank {rank} updated its parameters on an overflowing step"
        assert all(not t[3] for i, t in enumerate(trace) if i != 2), "clean steps must update"
    scales = [[t[:2] for t in trace] for trace, _ in results]
    assert scales[0] == scales[1], "ranks disagree on the loss scale"


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_keeps_losses_and_saves_activation_memory(mode):
    base = _single(_cfg(steps=5))
    recomputed = _single(_cfg(steps=5, recompute=mode))
    for a, b in zip(base.losses, recomputed.losses):
        assert abs(a - b) <= 1e-6
    base_bytes, recomputed_bytes = activation_bytes(base), activation_bytes(recomputed)
    assert recomputed_bytes < base_bytes
    if mode == "full":
        assert recomputed_bytes < 0.5 * base_bytes


@pytest.mark.slow
def test_fp8_under_data_parallel_zero_and_pipelines_and_bf16_under_zero_bubble_track_fp32(fp32_run):
    """FP8 linears (torchao, on CPU) composed with DP, ZeRO-1, ZeRO-3 and a 1F1B pipeline, and bf16 under the
    zero-bubble schedule (several autograd calls per backward, each folding gradients into fp32 buckets), at
    N = 2: each run held to the single-process fp32 curve as bf16 runs are."""
    pytest.importorskip("torchao")
    layouts = [dict(dp=2, precision="fp8"), dict(dp=2, zero=1, precision="fp8"), dict(dp=2, zero=3, precision="fp8"),
               dict(pp=2, microbatches=2, precision="fp8"),
               dict(pp=2, microbatches=2, schedule="zb", precision="bf16")]
    runs = run_ranks(_losses_and_val, 2, [_cfg(**layout) for layout in layouts], timeout=600)
    for layout, run in zip(layouts, runs[0]):
        if layout.get("pp", 1) == 1:
            _assert_tracks(fp32_run, run, str(layout))
    for layout, run in zip(layouts, runs[1]):
        if layout.get("pp", 1) > 1:  # the last stage holds the loss
            _assert_tracks(fp32_run, run, str(layout))
